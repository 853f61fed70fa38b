"""report.html: one self-contained page with the table, the figures and each run's config (and
the pieces a study's page is made of: report/study.py)."""

from __future__ import annotations

import base64
import html
import json
from pathlib import Path

import yaml

from moebalance.report.tables import headline, set_cells, table_cells


def _config_differences(configs: dict[str, dict]) -> list[tuple[str, list]]:
    keys = sorted({key for config in configs.values() for key in config})
    values = {key: [config.get(key) for config in configs.values()] for key in keys}
    return [(key, v) for key, v in values.items() if any(x != v[0] for x in v)]


_CSS = ("body{font-family:system-ui,sans-serif;margin:2em;max-width:1400px}"
        "table{border-collapse:collapse;margin:1em 0}"
        "th,td{border:1px solid #ccc;padding:2px 8px;text-align:right}"
        "th{background:#f0f0f0}.results tbody tr:last-child{font-weight:bold}"
        ".headline{font-size:1.15em;margin:0.3em 0}"
        "img{max-width:100%;display:block;margin:1em 0}"
        "pre{background:#f6f6f6;padding:1em;overflow:auto}")


def html_table(headers: list[str], rows: list[list[str]], css_class: str) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in row) + "</tr>"
                   for row in rows)
    return (f'<table class="{css_class}"><thead><tr>{head}</tr></thead>'
            f"<tbody>{body}</tbody></table>")


def write_html(out_dir, table: dict, figures, configs: dict[str, dict],
               title: str = "moebalance load-balancing report") -> Path:
    """One self-contained report.html: an A/B's headline (report.headline), the table, the
    figures ((PNG Path, caption) pairs) embedded as base64, each run's config.

    configs maps a run label to its config dict; settings that differ between runs are listed
    first.
    """
    headers, rows, notes = table_cells(table)
    parts = [f"<h1>{html.escape(title)}</h1>",
             *(f'<p class="headline">{html.escape(line)}</p>' for line in headline(table)),
             html_table(headers, rows, "results"),
             *(f"<p>{html.escape(note)}</p>" for note in notes)]
    if set_cells(table) is not None:
        headers, rows, set_title = set_cells(table)
        parts += [f"<p>{html.escape(set_title)}</p>", html_table(headers, rows, "set")]
    differences = _config_differences(configs)
    if len(configs) > 1 and differences:
        parts += ["<h2>Settings that differ</h2>",
                  html_table(["key", *configs], [[key, *map(json.dumps, v)]
                                                  for key, v in differences], "settings")]
    parts += ["<h2>Figures</h2>", *figure_parts(figures), "<h2>Configurations</h2>"]
    for label, config in configs.items():
        parts += [f"<h3>{html.escape(label)}</h3>",
                  f"<pre>{html.escape(yaml.safe_dump(config, sort_keys=False))}</pre>"]
    return write_page(out_dir, title, parts)


def figure_parts(figures) -> list[str]:
    """Each figure ((PNG Path, caption)) as its caption and the PNG embedded as base64."""
    parts = []
    for png, caption in figures:
        data = base64.b64encode(png.read_bytes()).decode("ascii")
        parts += [f"<p>{html.escape(caption)}</p>",
                  f'<img alt="{html.escape(png.name)}" src="data:image/png;base64,{data}">']
    return parts


def write_page(out_dir, title: str, parts: list[str]) -> Path:
    """out_dir/report.html: the HTML `parts` on one self-contained page titled `title`."""
    page = (f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">'
            f"<title>{html.escape(title)}</title><style>{_CSS}</style></head><body>"
            + "\n".join(parts) + "</body></html>\n")
    path = Path(out_dir) / "report.html"
    path.write_text(page, encoding="utf-8")
    return path
