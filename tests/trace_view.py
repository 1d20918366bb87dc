"""A trace as a trace viewer draws it: one row a span, indented under its parent, a bar on a shared time
axis (red where the span's status is an error), its duration and a few attributes beside it.

``waterfall(spans)`` returns a self-contained HTML page; the browser tests open it and take its picture
for the documentation (docs/observability.md).
"""

from __future__ import annotations

import html

from tests.otlp import Span

_SHOWN = (
    "omnigate.engine",
    "omnigate.policy.verdict",
    "omnigate.admission.outcome",
    "omnigate.outcome",
    "error.type",
    "omnigate.usage.input_images",
    "omnigate.audit.seq",
)


def _ordered(spans: list[Span]) -> list[tuple[int, Span]]:
    """Depth-first, children by start time: the order a waterfall lists them in."""
    ids = {s.span_id for s in spans}
    children: dict[str, list[Span]] = {}
    for s in spans:
        parent = s.parent_span_id if s.parent_span_id in ids else ""
        children.setdefault(parent, []).append(s)
    out: list[tuple[int, Span]] = []

    def walk(parent: str, depth: int) -> None:
        for s in sorted(children.get(parent, []), key=lambda x: x.start_ns):
            out.append((depth, s))
            walk(s.span_id, depth + 1)

    walk("", 0)
    return out


def waterfall(spans: list[Span], title: str) -> str:
    start = min(s.start_ns for s in spans)
    end = max(s.end_ns for s in spans)
    total = max(end - start, 1)
    rows = []
    for depth, s in _ordered(spans):
        left = 100 * (s.start_ns - start) / total
        width = max(100 * (s.end_ns - s.start_ns) / total, 0.3)
        error = s.status == 2
        service = s.resource.get("service.name", "")
        attrs = ", ".join(f"{k.split('.')[-1]}={s.attributes[k]}" for k in _SHOWN if k in s.attributes)
        rows.append(
            f'<tr><td class="name" style="padding-left:{8 + depth * 18}px">'
            f'<span class="svc">{html.escape(str(service))}</span> {html.escape(s.name)}</td>'
            f'<td class="lane"><div class="bar{" err" if error else ""}" '
            f'style="left:{left:.2f}%;width:{width:.2f}%"></div></td>'
            f'<td class="ms">{(s.end_ns - s.start_ns) / 1e6:.2f} ms</td>'
            f'<td class="attrs">{html.escape(attrs)}</td></tr>'
        )
    return f"""<!doctype html><html><head><meta charset="utf-8"><title>{html.escape(title)}</title><style>
body {{ font: 13px system-ui, sans-serif; margin: 16px; color: #1f2933; }}
h1 {{ font-size: 16px; margin: 0 0 4px; }} p {{ margin: 0 0 12px; color: #52606d; }}
table {{ border-collapse: collapse; width: 100%; }}
td {{ border-bottom: 1px solid #e4e7eb; padding: 4px 8px; white-space: nowrap; }}
td.lane {{ position: relative; width: 45%; }}
.bar {{ position: absolute; top: 6px; height: 12px; background: #3e7bfa; border-radius: 2px; }}
.bar.err {{ background: #d64545; }}
.svc {{ color: #7b8794; font-size: 11px; }} td.ms {{ text-align: right; color: #52606d; }}
td.attrs {{ color: #52606d; font-size: 12px; }}
</style></head><body><h1>{html.escape(title)}</h1>
<p>trace {spans[0].trace_id} · {len(spans)} spans · {total / 1e6:.1f} ms</p>
<table>{"".join(rows)}</table></body></html>"""
