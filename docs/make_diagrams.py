"""Draw the diagrams of docs/architecture.md from the code itself.

    PYTHONPATH=. python docs/make_diagrams.py       # writes docs/img/pipeline.png, stages.png

Nothing here is drawn by hand: every recipe in the registry is applied to a tiny random Llama
(6 layers, exit after 2), and the figures show what the code built.

- ``pipeline.png``: per recipe, capture -> its passes in the order ``PassPipeline`` runs them
  (arcs: the requires/provides DAG the pipeline checks with networkx, labelled with the fact)
  -> the stages its cut produced -> the schedule that runs them.
- ``stages.png``: for layerskip and kangaroo, which node of the rewritten graph each stage
  (``full``, ``draft``, ``verify``) runs, read from the stages' own fx graphs.
"""

from __future__ import annotations

import functools
import sys
import tempfile
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch  # noqa: E402

from leapfx import rewrite  # noqa: E402
from leapfx.passes.base import CAPTURED_FACTS, PassPipeline  # noqa: E402
from leapfx.recipes.table import RECIPES  # noqa: E402

OUT = Path(__file__).resolve().parent / "img"
LAYERS, EXIT = 6, 2
COLORS = {"capture": "#d9d9d9", "pass": "#9ecae1", "stages": "#a1d99b", "schedule": "#fdd0a2"}


def tiny_llama() -> torch.nn.Module:
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=LAYERS,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=128,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


def recipe_options(name: str) -> dict:
    return {} if name == "autoregressive" else {"exit_layer": EXIT}


def schedule_name(schedule) -> str:
    while isinstance(schedule, functools.partial):
        schedule = schedule.func
    return f"{schedule.__module__.rsplit('.', 1)[-1]}.{schedule.__name__}"


def box(ax, x, y, text, kind, width=2.5):
    ax.add_patch(
        FancyBboxPatch(
            (x - width / 2, y - 0.22), width, 0.44, boxstyle="round,pad=0.02",
            facecolor=COLORS[kind], edgecolor="#444444", linewidth=0.8,
        )
    )  # fmt: skip
    ax.text(x, y, text, ha="center", va="center", fontsize=7.5)


def arrow(ax, a, b, *, label=None, rad=0.0):
    ax.add_patch(
        FancyArrowPatch(
            a, b, arrowstyle="-|>", mutation_scale=10, linewidth=0.9, color="#333333",
            connectionstyle=f"arc3,rad={rad}", shrinkA=2, shrinkB=2,
        )
    )  # fmt: skip
    if label:
        mid = ((a[0] + b[0]) / 2, max(a[1], b[1]) + 0.32 + abs(rad) * 0.9)
        ax.text(*mid, label, ha="center", va="bottom", fontsize=7, color="#555555", style="italic")


def draw_pipeline(model, path: Path, adapter_dir: Path) -> None:
    # Every recipe with its defaults, and kangaroo once more loading a saved adapter (the one
    # pipeline where one pass requires what another provides).
    rows = [(name, recipe_options(name)) for name in RECIPES]
    rows.append(("kangaroo", {"exit_layer": EXIT, "adapter": str(adapter_dir)}))
    fig, ax = plt.subplots(figsize=(13, 1.45 * len(rows) + 0.6))
    step = 2.8
    for row, (name, options) in enumerate(rows):
        recipe = RECIPES[name]
        sm = rewrite.apply(model, name, **options)
        pipeline = PassPipeline(recipe.passes(sm.options))
        dag = pipeline.dag()
        y = -row * 1.45
        label = name + ("\n(adapter=dir)" if "adapter" in options else "")
        ax.text(-1.4, y, label, ha="right", va="center", fontsize=10, weight="bold")
        box(ax, 0, y, "capture", "capture")
        xs = {}
        for i, p in enumerate(pipeline.passes):
            xs[i] = step * (i + 1)
            box(ax, xs[i], y, p.name, "pass")
            arrow(ax, (xs[i] - step + 1.25, y), (xs[i] - 1.25, y))
        for a, b, data in dag.edges(data=True):  # a fact one pass provides and another requires
            arrow(ax, (xs[a], y + 0.22), (xs[b], y + 0.22), label=data["fact"], rad=-0.35)
        if pipeline.passes:
            fact = sorted(CAPTURED_FACTS)[0]
            ax.text(step / 2, y + 0.3, fact, ha="center", fontsize=7, color="#555555",
                    style="italic")  # fmt: skip
        x_cut = step * (len(pipeline.passes) + 1)
        arrow(ax, (x_cut - step + 1.25, y), (x_cut - 1.25, y))
        box(ax, x_cut, y, "stages: " + ", ".join(sm.stages.modules), "stages")
        arrow(ax, (x_cut + 1.25, y), (x_cut + step - 1.25, y))
        box(ax, x_cut + step, y, schedule_name(sm.recipe.schedule), "schedule")
    ax.set_xlim(-2.6, step * 5 + 1.4)
    ax.set_ylim(-1.45 * (len(rows) - 1) - 0.6, 1.0)
    ax.axis("off")
    ax.set_title(
        f"Each recipe: capture -> passes (order and arcs from the requires/provides DAG) -> "
        f"partition -> schedule  (tiny Llama, {LAYERS} layers, exit after {EXIT})",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def stage_rows(sm) -> tuple[list[str], dict[str, set[str]]]:
    """Nodes of the rewritten graph (plus verify's join) and, per stage, the ones it runs."""
    skip = ("placeholder", "output")
    rows = [n.name for n in sm.graph_module.graph.nodes if n.op not in skip]
    rows.insert(rows.index(f"layer_{EXIT}"), "exit_query_cache")
    runs = {}
    for stage, gm in sm.stages.modules.items():
        # A node copied twice into one stage (verify's rotary and masks) gets a _1 suffix.
        names = {n.name for n in gm.graph.nodes if n.op not in skip}
        runs[stage] = {n if n in rows else n.removesuffix("_1") for n in names}
    return rows, runs


def draw_stages(model, path: Path) -> None:
    recipes = ("layerskip", "kangaroo")
    fig, axes = plt.subplots(1, 2, figsize=(9.5, 6.2))
    colors = {"full": "#6baed6", "draft": "#fd8d3c", "verify": "#74c476"}
    for ax, name in zip(axes, recipes, strict=True):
        sm = rewrite.apply(model, name, exit_layer=EXIT)
        rows, runs = stage_rows(sm)
        stages = list(runs)
        for j, stage in enumerate(stages):
            for i, node in enumerate(rows):
                on = node in runs[stage]
                ax.add_patch(
                    plt.Rectangle(
                        (j + 0.06, i + 0.08), 0.88, 0.84,
                        facecolor=colors[stage] if on else "#f2f2f2", edgecolor="white",
                    )
                )  # fmt: skip
        ax.set_xlim(0, len(stages))
        ax.set_ylim(len(rows), 0)
        ax.set_xticks([j + 0.5 for j in range(len(stages))], stages)
        ax.xaxis.tick_top()
        ax.set_yticks([i + 0.5 for i in range(len(rows))], rows, fontsize=8.5)
        ax.tick_params(length=0)
        for side in ax.spines.values():
            side.set_visible(False)
        ax.set_title(f"{name} (exit after layer_{EXIT - 1})", fontsize=10, pad=22)
    fig.suptitle("Which graph nodes each stage runs (from the stages' fx graphs)", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> int:
    OUT.mkdir(exist_ok=True)
    model = tiny_llama()
    with tempfile.TemporaryDirectory() as tmp:
        # An untrained adapter saved and loaded back: enough to build the loading pipeline.
        rewrite.apply(model, "kangaroo", exit_layer=EXIT).save_adapter(tmp)
        draw_pipeline(model, OUT / "pipeline.png", Path(tmp))
    draw_stages(model, OUT / "stages.png")
    for name in ("pipeline.png", "stages.png"):
        print(OUT / name, (OUT / name).stat().st_size, "bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
