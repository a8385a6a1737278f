"""The calls a Relax function makes, by name, for the dispatch passes' Before/After tests."""

from tvm import relax


def call_names(func: relax.Function) -> list[str]:
    """Each call's operator name in post order; a call_tir by the PrimFunc it calls."""
    names = []

    def visit(e):
        if isinstance(e, relax.Call):
            names.append(e.args[0].name_hint if e.op.name == "relax.call_tir" else e.op.name)

    relax.analysis.post_order_visit(func.body, visit)
    return names
