"""Scheme options are declared once, with the generator (chimera.schedules.registry): the CLI
flags, TrainConfig (and the reference run of equivalence checks), the planner, the labels and
the closed forms follow from the declaration."""

import pytest

from chimera.cli import main
from chimera.theory.formulas import closed_form
from chimera.plan.search import variants
from chimera.schedules import build, get_scheme, registry
from chimera.schedules.classic import one_f_one_b
from chimera.schedules.registry import Option, register
from chimera.train.config import ConfigError, TrainConfig
from chimera.train.equivalence import reference_config


@pytest.fixture
def echo(monkeypatch):
    """A scheme with an option no other scheme has; it records what its generator was given."""
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))
    seen = []

    @register("echo-test", "1F1B that records its option",
              options=(Option("warmth", int, "a test option", symbol="w",
                              search=lambda depth, layers: [1, depth]),
                       Option("tint", str, "another", choices=("red", "blue"))))
    def echo_test(stages: int, micro_batches: int, warmth: int = 1, tint: str = "red"):
        seen.append((warmth, tint))
        return one_f_one_b(stages, micro_batches)

    return seen


def test_a_declared_option_is_a_flag_of_show(echo, capsys):
    with pytest.raises(SystemExit):
        main(["show", "--help"])
    out = capsys.readouterr().out
    assert "--warmth" in out and "echo-test: a test option (default: 1)" in " ".join(out.split())
    assert "{red,blue}" in out


def test_a_flag_reaches_the_generator(echo, capsys):
    assert main(["show", "-s", "echo-test", "-D", "2", "-N", "2", "--warmth", "3", "--tint", "blue"]) == 0
    assert echo[-1] == (3, "blue")


def test_train_config_accepts_and_passes_the_option(echo):
    TrainConfig(schedule="echo-test", stages=2, options={"warmth": 4}).preflight()
    assert echo[-1] == (4, "red")


@pytest.mark.parametrize("options, message", [
    ({"warmth": 0}, "option warmth must be a positive integer"),
    ({"tint": "green"}, "option tint must be one of red, blue"),
    ({"cap": 2}, "does not take option"),
])
def test_train_config_refuses_a_bad_value_in_one_line(echo, options, message):
    with pytest.raises(ConfigError, match=message):
        TrainConfig(schedule="echo-test", stages=2, options=options).preflight()


def test_the_planner_searches_the_declared_values_and_labels_them(echo):
    assert variants("echo-test", 4, 8) == [(("warmth", 1),), (("warmth", 4),)]
    assert get_scheme("echo-test").label((("warmth", 4), ("tint", "blue"))) == "echo-test w=4 blue"


def test_an_undeclared_keyword_argument_is_refused_at_registration(monkeypatch):
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))
    with pytest.raises(TypeError, match="differ from the generator's keyword arguments"):
        register("bad-test", "x")(lambda stages, micro_batches, flavor=1: None)
    with pytest.raises(TypeError, match="declared differently"):
        register("bad-test", "x", options=(Option("pipes", str, "not an int"),))(
            lambda stages, micro_batches, pipes="2": None)


def test_build_checks_values_against_the_declaration():
    with pytest.raises(ValueError, match="option strategy must be one of direct, doubling, halving"):
        build("chimera", 4, 4, strategy="sideways")
    with pytest.raises(ValueError, match="option exact must be an integer >= 0"):
        build("chimera-zb", 4, 4, exact=-1)


@pytest.fixture
def lagged(monkeypatch):
    """1F1B given a new option the way a generator would add one: only its declaration."""
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))

    @register("1f1b", get_scheme("1f1b").description,
              options=(Option("lag", int, "a new option", low=0),))
    def lagged_1f1b(stages: int, micro_batches: int, lag: int = 0):
        return one_f_one_b(stages, micro_batches)


def test_a_closed_form_does_not_claim_an_option_it_does_not_take(lagged, capsys):
    assert closed_form("1f1b", 4, 8) == closed_form("1f1b", 4, 8, lag=0) == closed_form("1f1b", 4, 8, lag=None)
    assert closed_form("1f1b", 4, 8).bubble == pytest.approx(3 / 11)
    assert closed_form("1f1b", 4, 8, lag=2) is None
    assert main(["simulate", "-s", "1f1b", "-D", "4", "-N", "8"]) == 0
    assert "closed form: bubble (D-1)/(N+D-1)" in capsys.readouterr().out
    assert main(["simulate", "-s", "1f1b", "-D", "4", "-N", "8", "--lag", "2"]) == 0
    assert "closed form" not in capsys.readouterr().out


def test_train_config_passes_a_new_option_and_the_reference_drops_it(lagged):
    cfg = TrainConfig(schedule="1f1b", stages=2, options={"lag": 2})
    assert cfg.pipeline.scheme_options["lag"] == 2 and "lag" not in TrainConfig.option_fields()
    cfg.preflight()
    halving = TrainConfig(stages=2, strategy="halving", pipes=2, options={"lag": 2})
    ref = reference_config(halving)
    assert ref.reference and ref.pipeline.options == ()
