"""``report.md`` and its PNG plots: what each stage kept, and why the rest went.

Plots (matplotlib, drawn off-screen): documents and bytes kept per stage; the quality score
histogram with the Pareto keep curve; duplicate cluster sizes; decontamination hits per task.
Without matplotlib the report is written without plots.
"""

from __future__ import annotations

import os

import numpy as np

from data_pipeline.curate.quality import HIST_BINS, keep_probability
from data_pipeline.curate.shards import atomic_write_text


def write_report(out_dir: str, stages: list[dict]) -> str:
    plot_dir = os.path.join(out_dir, "report")
    os.makedirs(plot_dir, exist_ok=True)
    lines = ["# Curation report", "", "| stage | documents in | documents out | MB out | seconds | dropped |",
             "|---|---:|---:|---:|---:|---|"]
    for s in stages:
        lines.append(f"| {s['stage']} | {s['docs_in']} | {s['docs_out']} | {s['bytes_out'] / 1e6:.3f} | "
                     f"{s.get('seconds', 0):.1f} | {changes(s) or '-'} |")
    bad = {r: n for s in stages for r, n in s.get("bad_records", {}).items()}
    if bad:
        lines += ["", "Bad input records (left out; `--strict` makes them fatal): "
                  + ", ".join(f"{n} {r}" for r, n in sorted(bad.items())) + ". First ones:", ""]
        lines += [f"- `{e}`" for s in stages for e in s.get("bad_examples", [])]
    plots = _plots(plot_dir, stages)
    lines += [""] + [f"![{title}](report/{name})" for title, name in plots]
    path = os.path.join(out_dir, "report.md")
    atomic_write_text(path, "\n".join(lines) + "\n")
    return path


def changes(stats: dict) -> str:
    """What a stage did to the documents it did not pass on as they were: those dropped, by reason, and
    those cut into pieces (decontamination), so that in - dropped - cut + pieces = out."""
    said = [f"{n} {reason}" for reason, n in sorted(stats.get("dropped", {}).items())]
    if stats.get("cut"):
        said.append(f"{stats['cut']} cut into {stats['pieces']} pieces")
    return ", ".join(said)


def _plots(plot_dir: str, stages: list[dict]) -> list[tuple[str, str]]:
    """The plots, drawn on figures of their own (no pyplot): a caller's matplotlib backend and open
    figures, in a notebook say, stay as they were."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        return []
    made = []

    def figure(columns: int = 1, size=(6, 3.5)):
        fig = Figure(figsize=size)
        return fig, fig.subplots(1, columns)

    def save(fig, title, name):
        fig.suptitle(title)
        fig.tight_layout()
        fig.savefig(os.path.join(plot_dir, name), dpi=90)
        made.append((title, name))

    names = [s["stage"] for s in stages]
    fig, axes = figure(2, (10, 3.5))
    axes[0].bar(names, [s["docs_out"] for s in stages])
    axes[0].set_ylabel("documents kept")
    axes[1].bar(names, [s["bytes_out"] / 1e6 for s in stages])
    axes[1].set_ylabel("MB kept")
    for ax in axes:
        ax.tick_params(axis="x", rotation=30)
    save(fig, "Documents and bytes after each stage", "kept.png")
    for s in stages:
        if "score_histogram" in s:
            centres = (np.arange(HIST_BINS) + 0.5) / HIST_BINS
            fig, ax = figure()
            ax.bar(centres, s["score_histogram"], width=1 / HIST_BINS, alpha=0.5, label="scored")
            ax.bar(centres, s["kept_histogram"], width=1 / HIST_BINS, alpha=0.7, label="kept")
            ax.set_xlabel("quality score P(hq)")
            ax.set_ylabel("documents")
            twin = ax.twinx()
            grid = np.linspace(0, 1, 101)
            twin.plot(grid, keep_probability(grid, s["alpha"]), color="black", label="keep probability")
            twin.set_ylim(0, 1.05)
            ax.legend(loc="upper left")
            save(fig, f"Quality scores and the Pareto keep curve (alpha = {s['alpha']:g})", "quality.png")
        if s.get("cluster_sizes"):
            sizes = sorted(s["cluster_sizes"].items(), key=lambda kv: int(kv[0]))
            fig, ax = figure()
            ax.bar([k for k, _ in sizes], [v for _, v in sizes])
            ax.set_xlabel("documents in a near-duplicate cluster")
            ax.set_ylabel("clusters")
            save(fig, "Near-duplicate cluster sizes", "clusters.png")
        if s.get("hits"):
            fig, ax = figure()
            ax.bar(list(s["hits"]), list(s["hits"].values()))
            ax.set_ylabel(f"{s['ngram']}-gram hits" if "ngram" in s else "n-gram hits")  # older stats lack it
            save(fig, "Decontamination hits per task", "decontamination.png")
    return made
