"""Benchmark reports: a markdown table and PNG plots per mode, in one output folder.

report = Report(out_dir, "scheduler")
report.table("Throughput", ["side", "tokens/s"], rows)
report.bars("throughput", "tokens/s", {"APRIL": 1.2e4, "baseline": 7e3})
report.histogram("response_lengths", {"budgets": lengths}, "tokens", log_y=True)
report.lines("reward_vs_time", {"APRIL": (t, r), "baseline": (t, r)}, "s", "reward")
report.write(command, result)   # <out_dir>/<mode>.md, plots beside it
"""

from __future__ import annotations

import json
import os
from typing import Any, Sequence

import numpy as np


def _plt():
  import matplotlib  # pylint: disable=g-import-not-at-top

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

  return plt


class Report:

  def __init__(self, out_dir: str, mode: str):
    self.out_dir, self.mode = out_dir, mode
    os.makedirs(out_dir, exist_ok=True)
    self._sections: list[str] = []
    self.files: list[str] = []

  def table(self, title: str, headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    fmt = lambda v: f"{v:,.3f}" if isinstance(v, float) else str(v)
    lines = [f"### {title}", "", "| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(fmt(v) for v in row) + " |" for row in rows]
    self._sections.append("\n".join(lines))

  def _save(self, fig, name: str) -> None:
    path = os.path.join(self.out_dir, f"{self.mode}_{name}.png")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    _plt().close(fig)
    self.files.append(path)
    self._sections.append(f"![{name}]({os.path.basename(path)})")

  def bars(self, name: str, ylabel: str, values: dict[str, float]) -> None:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.bar(
        list(values),
        list(values.values()),
        color=["tab:blue", "tab:gray", "tab:green", "tab:orange"][: len(values)],
    )
    for i, v in enumerate(values.values()):
      ax.text(i, v, f"{v:,.0f}" if v > 10 else f"{v:.3f}", ha="center", va="bottom")
    ax.set_ylabel(ylabel)
    ax.set_title(name.replace("_", " "))
    self._save(fig, name)

  def histogram(
      self,
      name: str,
      series: dict[str, np.ndarray],
      xlabel: str,
      log_y: bool = False,
      bins: int | np.ndarray = 40,
  ) -> None:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for label, values in series.items():
      ax.hist(np.asarray(values), bins=bins, alpha=0.6, label=label)
    if log_y:
      ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("count")
    ax.legend()
    ax.set_title(name.replace("_", " "))
    self._save(fig, name)

  def lines(
      self,
      name: str,
      series: dict[str, tuple[np.ndarray, np.ndarray]],
      xlabel: str,
      ylabel: str,
      hline: tuple[str, float] | None = None,
  ) -> None:
    """One line per series; `hline` (label, y) draws a dashed reference level."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for label, (x, y) in series.items():
      ax.plot(x, y, label=label)
    if hline is not None:
      ax.axhline(hline[1], color="gray", linestyle="--", linewidth=1, label=hline[0])
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.legend()
    ax.set_title(name.replace("_", " "))
    self._save(fig, name)

  def write(self, command: str, result: dict[str, Any]) -> str:
    path = os.path.join(self.out_dir, f"{self.mode}.md")
    body = [
        f"# Benchmark: {self.mode}",
        "",
        "```",
        command,
        "```",
        "",
        *("\n" + s + "\n" for s in self._sections),
        "",
        "<details><summary>JSON</summary>",
        "",
        "```json",
        json.dumps(result, indent=1, sort_keys=True, default=str),
        "```",
        "</details>",
        "",
    ]
    with open(path, "w", encoding="utf-8") as f:
      f.write("\n".join(body))
    self.files.append(path)
    return path
