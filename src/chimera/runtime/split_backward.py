"""Split backward through plain autograd: I (input gradient) now, W (weight gradients) later.

I runs ``autograd.grad`` towards the stage input only. Autograd then evaluates each node
for just the outputs that lead to the input, so where a node also feeds a weight (a
Linear's addmm, a LayerNorm) only its input-gradient half runs. A pre-hook on each such
*boundary* node keeps the gradient that flowed into it. W later restarts autograd at each
boundary node (``GradientEdge``) with the kept gradient, towards the weights right below
that node only: one engine call per boundary, because a call that asked for every weight
would also walk down the input path into deeper boundaries and count their weights twice.
Each node's weight half runs once, and the graph is freed as W finishes. No custom layers
are needed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.autograd.graph import GradientEdge


@dataclass
class Boundary:
    """One boundary node: its output edges, the gradients that reached them, its weights."""

    params: list[torch.nn.Parameter]
    edges: list[GradientEdge] = field(default_factory=list)
    grads: list[torch.Tensor] = field(default_factory=list)


@dataclass
class PendingWeightGrad:
    """What W needs: the boundaries (or, on a first stage, the plain output and gradient)."""

    params: list[torch.nn.Parameter] = field(default_factory=list)
    boundaries: list[Boundary] = field(default_factory=list)
    # when there is no input gradient to split off (first stage), W is a plain backward
    output: torch.Tensor | None = None
    output_grad: torch.Tensor | None = None


def _graph(root) -> tuple[list, dict]:
    """Nodes reachable from ``root`` children first (post-order), and each node's children."""
    order, kids, done, stack = [], {}, set(), [root]
    while stack:
        node = stack[-1]
        if node in done:
            stack.pop()
            continue
        if node not in kids:
            kids[node] = [c for c, _ in node.next_functions if c is not None]
        todo = [c for c in kids[node] if c not in done]
        if todo:
            stack.extend(todo)
            continue
        stack.pop()
        done.add(node)
        order.append(node)
    return order, kids


def _boundaries(root, xs: list[torch.Tensor], params: list[torch.nn.Parameter]) -> list[tuple]:
    """(node, weights below it) for nodes on the inputs' paths with a weight-only child."""
    order, kids = _graph(root)
    to_x, x_ids = set(), {id(x) for x in xs}
    for node in order:  # children first, so their flags are known
        var = getattr(node, "variable", None)
        if var is not None:
            if id(var) in x_ids:
                to_x.add(node)
        elif any(c in to_x for c in kids[node]):
            to_x.add(node)
    by_id = {id(p): p for p in params}
    out = []
    for node in order:
        if node in to_x:
            off_path = [c for c in kids[node] if c not in to_x]
            weights = _params_below(off_path, kids, by_id) if off_path else ()
            if weights:
                out.append((node, [by_id[i] for i in sorted(weights)]))
    return out


def _params_below(starts: list, kids: dict, by_id: dict) -> set[int]:
    """Ids of the parameters reached from ``starts`` (subgraphs off the input's path)."""
    found, seen, stack = set(), set(), list(starts)
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        var = getattr(node, "variable", None)
        if var is not None:
            if id(var) in by_id:
                found.add(id(var))
            continue
        stack.extend(kids[node])
    return found


def _shared(boundaries: list[tuple]) -> bool:
    """Whether a weight lies below two boundaries (a layer applied twice, tied weights used on
    the input path): W restarted at the upper one would also run the lower one's part."""
    seen: set[int] = set()
    for _, weights in boundaries:
        ids = {id(p) for p in weights}
        if ids & seen:
            return True
        seen |= ids
    return False


# The engine call under torch.autograd.grad/backward, without their argument handling: ~40%
# of a small stage's call (7 of 18 us warm), and several times that on a host just woken from
# a wait, once per I, W and B. Private in torch (Megatron's pipeline calls the engine directly
# for the same reason); where a torch lacks it, the public calls.
_ENGINE = getattr(torch.autograd.graph, "_engine_run_backward", None)


def _roots(outputs, grads) -> tuple[tuple, tuple]:
    """Outputs and their gradients as the engine takes them, checked as autograd.grad checks
    them (the engine would broadcast a gradient of another shape without a word): a missing
    gradient is ones for a scalar tensor (a loss), as autograd makes it."""
    full = []
    for y, g in zip(outputs, grads):
        tensor = isinstance(y, torch.Tensor)
        if g is None:
            if not tensor or y.numel() != 1:
                raise RuntimeError("grad can be implicitly created only for scalar outputs")
            g = torch.ones_like(y, memory_format=torch.preserve_format)
        elif tensor and g.shape != y.shape:
            raise RuntimeError(f"Mismatch in shape: grad_output has a shape of {tuple(g.shape)} "
                               f"and output has a shape of {tuple(y.shape)}")
        full.append(g)
    return tuple(outputs), tuple(full)


def grad_of(outputs: list, grads: list, inputs: list, keep_graph: bool = False) -> tuple:
    """``torch.autograd.grad(outputs, inputs, grads, retain_graph=keep_graph,
    allow_unused=True)``: outputs may be tensors or GradientEdges; None for an input the
    outputs do not reach."""
    if not _ENGINE:
        return torch.autograd.grad(outputs, inputs, grads, retain_graph=keep_graph,
                                   allow_unused=True)
    outputs, grads = _roots(outputs, grads)
    return _ENGINE(outputs, grads, keep_graph, False, tuple(inputs), True, accumulate_grad=False)


def backward_of(outputs: list, grads: list, inputs: list | None = None) -> None:
    """``torch.autograd.backward(outputs, grads, inputs=inputs)``: gradients accumulate into
    the ``.grad`` of ``inputs`` (None: of every leaf the outputs reach)."""
    if not _ENGINE:
        torch.autograd.backward(outputs, grads, inputs=inputs)
        return
    if inputs is not None and not len(inputs):  # () would mean every leaf to the engine
        raise RuntimeError("'inputs' argument to backward() cannot be empty.")
    outputs, grads = _roots(outputs, grads)
    _ENGINE(outputs, grads, False, False, tuple(inputs or ()), True, accumulate_grad=True)


def _input_grads(y, xs: list[torch.Tensor], grad) -> list[torch.Tensor | None]:
    # an input leaf the output does not depend on (a mask passed through) gets None
    return list(grad_of([y], [grad], xs, keep_graph=True))


def backward_input(y: torch.Tensor, x, grad: torch.Tensor | None,
                   params: list[torch.nn.Parameter]) -> tuple:
    """I: return dL/dx and what W needs. ``grad`` is dL/dy (None when y is the loss).

    ``x`` is one input tensor (dL/dx returned as a tensor) or a list of them (a list of
    gradients, None for an input ``y`` does not depend on)."""
    xs = None if x is None else ([x] if isinstance(x, torch.Tensor) else list(x))
    pending = PendingWeightGrad(params=[p for p in params if p.requires_grad])
    if xs and any(y is t for t in xs):  # a pass-through stage: its output is its input
        dxs = [grad if y is t else None for t in xs]
        return (dxs[0] if isinstance(x, torch.Tensor) else dxs), pending
    if not xs or y.grad_fn is None:
        pending.output, pending.output_grad = y, grad
        return None, pending
    dxs = _backward_input(y, xs, grad, pending)
    return (dxs[0] if isinstance(x, torch.Tensor) else dxs), pending


def _backward_input(y, xs: list[torch.Tensor], grad, pending: PendingWeightGrad) -> list:
    found = _boundaries(y.grad_fn, xs, pending.params)
    # no boundary: the output does not depend on the input (or no weight joins its path), so
    # there is nothing to split; W runs a plain backward to the weights. Weights below two
    # boundaries: W at one would walk into the other's; no split either.
    if (not found and pending.params) or _shared(found):
        pending.output, pending.output_grad = y, grad
        return _input_grads(y, xs, grad)
    handles = []
    for node, weights in found:
        boundary = Boundary(weights)
        pending.boundaries.append(boundary)

        def keep(grad_outputs, node=node, boundary=boundary):
            for i, g in enumerate(grad_outputs):
                if g is not None:
                    boundary.edges.append(GradientEdge(node, i))
                    boundary.grads.append(g)
        handles.append(node.register_prehook(keep))
    try:
        return _input_grads(y, xs, grad)
    finally:
        # removed, not left switched off: a hook holds its node and boundary, the boundary its
        # edges and so the node, a cycle that would keep the graph until a garbage collection
        for h in handles:
            h.remove()


def backward_weight(pending: PendingWeightGrad) -> None:
    """W: accumulate the weight gradients into ``.grad`` and free the graph."""
    if not pending.params:  # a frozen stage: no weight gradient to compute
        pending.output = None
        pending.boundaries.clear()
        return
    if pending.output is not None:
        backward_of([pending.output], [pending.output_grad], pending.params)
        return
    for b in pending.boundaries:
        if not b.edges:
            continue
        grads = grad_of(b.edges, b.grads, b.params)
        for p, g in zip(b.params, grads):
            if g is None:
                continue
            if p.grad is None:
                p.grad = g
            else:
                p.grad.add_(g)
    pending.boundaries.clear()
