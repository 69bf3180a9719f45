"""The paper's closed forms: bubble bounds, formulas, tables."""
