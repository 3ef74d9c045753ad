"""The dashboard page: one self-contained HTML document (inline CSS and SVG, no script, no CDN), rendered
on the server from the collector's data and refreshed by the browser every few seconds.

Every number a test or a person may want to check carries a `data-k` attribute (the chart points their
`data-step`/`data-value`), so a headless browser can read back what it shows.

Everything interpolated goes through `_e` (or `_num`, which escapes what is not a float): nodes and
validators are peers, and any string they return (a node's `policy_version` or `state` from `/health`,
a validator's reason names or counts) may be markup meant for the operator's browser.
"""

from __future__ import annotations

import html
import time
from typing import Any

REFRESH_S = 5
TOKEN = 10**18
COLORS = {"accepted": "#2e7d32", "rejected_hard": "#c62828", "rejected_soft": "#ef6c00", "pending": "#9e9e9e"}


def _e(value: Any) -> str:
    return html.escape(str(value), quote=True)


def _num(value: Any, digits: int = 3) -> str:
    """A number as shown (escaped: a peer may put anything where a number belongs)."""
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return _e(value)


def _short(address: str) -> str:
    return f"{address[:6]}…{address[-4:]}" if len(address) > 12 else address


def _axes(w: int, h: int, pad: int, x_label: str, y_label: str, y_max: float, y_min: float = 0.0) -> str:
    return (f'<line x1="{pad}" y1="{h - pad}" x2="{w - 8}" y2="{h - pad}" class="axis"/>'
            f'<line x1="{pad}" y1="8" x2="{pad}" y2="{h - pad}" class="axis"/>'
            f'<text x="{w - 8}" y="{h - 6}" text-anchor="end">{_e(x_label)}</text>'
            f'<text x="{pad + 6}" y="14">{_e(y_label)}</text>'
            f'<text x="{pad - 4}" y="{h - pad}" text-anchor="end">{_num(y_min, 2)}</text>'
            f'<text x="{pad - 4}" y="18" text-anchor="end">{_num(y_max, 2)}</text>')


def reward_chart(rewards: list[dict[str, Any]], w: int = 560, h: int = 220, pad: int = 40) -> str:
    points = [(r["step"], r["reward_mean"]) for r in rewards
              if isinstance(r.get("step"), int) and isinstance(r.get("reward_mean"), int | float)]
    if not points:
        return '<p class="empty">no trainer step yet</p>'
    x_max = max(max(s for s, _ in points), 1)
    lo, hi = min(0.0, min(v for _, v in points)), max(max(v for _, v in points), 1e-9)
    span = hi - lo or 1.0

    def xy(step: int, value: float) -> tuple[float, float]:
        return pad + (w - pad - 8) * step / x_max, (h - pad) - (h - pad - 8) * (value - lo) / span

    path = " ".join(f"{'M' if i == 0 else 'L'}{x:.1f},{y:.1f}" for i, (x, y) in enumerate(xy(s, v) for s, v in points))
    dots = "".join(
        f'<circle cx="{x:.1f}" cy="{y:.1f}" r="2.5" data-step="{_e(s)}" data-value="{v:.6f}"><title>step {s}: '
        f'{v:.4f}</title></circle>' for s, v in points for x, y in [xy(s, v)])
    return (f'<svg viewBox="0 0 {w} {h}" width="{w}" height="{h}" id="reward-chart" role="img" '
            f'aria-label="reward per trainer step">{_axes(w, h, pad, "trainer step", "mean reward", hi, lo)}'
            f'<path d="{path}" class="line"/>{dots}</svg>')


def submissions_chart(sub: dict[str, Any], w: int = 560, h: int = 220, pad: int = 40) -> str:
    bins = sub.get("bins") or []
    if not bins:
        return '<p class="empty">no submission yet</p>'
    kinds = list(COLORS)
    top = max(max(sum(b[k] for k in kinds) for b in bins), 1)
    bar_w = (w - pad - 8) / len(bins)
    rects = []
    for i, b in enumerate(bins):
        y = h - pad
        for k in kinds:
            if b[k]:
                bh = (h - pad - 8) * b[k] / top
                y -= bh
                rects.append(f'<rect x="{pad + i * bar_w:.1f}" y="{y:.1f}" width="{max(bar_w - 1, 1):.1f}" '
                             f'height="{bh:.1f}" fill="{COLORS[k]}" data-bin="{i}" data-kind="{k}" '
                             f'data-value="{_e(b[k])}"><title>{_e(time.strftime("%H:%M:%S", time.localtime(b["t"])))} '
                             f'+{sub["bin_s"]:.0f} s: {_e(b[k])} {k}</title></rect>')
    legend = "".join(f'<span class="key" style="background:{c}"></span>{_e(k)} ' for k, c in COLORS.items())
    x_label = f"time ({sub['bin_s']:.0f} s bins)"
    return (f'<svg viewBox="0 0 {w} {h}" width="{w}" height="{h}" id="submissions-chart" role="img" '
            f'aria-label="submissions over time">{_axes(w, h, pad, x_label, "submissions", top)}'
            f'{"".join(rects)}</svg><div class="legend">{legend}</div>')


def propagation_chart(nodes: list[dict[str, Any]], w: int = 560, h: int = 220, pad: int = 40) -> str:
    series = [(str(n["name"]), d["version"], d["delay_s"]) for n in nodes for d in n["propagation"]["versions"]
              if isinstance(d.get("version"), int) and isinstance(d.get("delay_s"), int | float)]
    if not series:
        return '<p class="empty">no version has reached a node yet</p>'
    v_min, v_max = min(v for _, v, _ in series), max(v for _, v, _ in series)
    v_span = max(v_max - v_min, 1)
    d_max = max(max(d for _, _, d in series), 1e-3)
    names = sorted({s for s, _, _ in series})
    palette = ["#1565c0", "#6a1b9a", "#00838f", "#ad1457", "#558b2f", "#4e342e", "#283593", "#f9a825"]
    dots = "".join(
        f'<circle cx="{pad + 6 + (w - pad - 20) * (v - v_min) / v_span:.1f}" cy="{(h - pad) - (h - pad - 8) * d / d_max:.1f}" r="3" '
        f'fill="{palette[names.index(s) % len(palette)]}" data-node="{_e(s)}" data-version="{_e(v)}" data-value="{_e(d)}">'
        f'<title>{_e(s)} v{_e(v)}: {d:.2f} s</title></circle>' for s, v, d in series)
    legend = "".join(f'<span class="key" style="background:{palette[i % len(palette)]}"></span>{_e(s)} '
                     for i, s in enumerate(names))
    return (f'<svg viewBox="0 0 {w} {h}" width="{w}" height="{h}" id="propagation-chart" role="img" '
            f'aria-label="seconds from a version\'s signing to a node\'s first batch at it">'
            f'{_axes(w, h, pad, f"policy version (v{v_min} to v{v_max})", "seconds to reach the node", d_max)}'
            f'{dots}</svg>'
            f'<div class="legend">{legend}</div>')


def _share(part: Any, whole: Any) -> str:
    return f"{part / whole:.1%}" if isinstance(part, int) and isinstance(whole, int) and whole > 0 else "-"


def published_table(published: dict[str, Any]) -> str:
    """Bytes per published version (what travels, against the full weights), from `devnet/published.py`'s rows."""
    rows = published.get("versions") or []
    if not rows:
        return '<p class="empty">no version in the origin\'s store yet</p>'
    body = "".join(
        f'<tr data-version="{_e(r.get("version"))}"><td>{_e(r.get("version"))}</td>'
        f'<td data-k="published.{_e(r.get("version"))}.kind" class="{"delta" if r.get("kind") == "delta" else "anchor"}">'
        f'{_e(r.get("kind"))}</td>'
        f'<td data-k="published.{_e(r.get("version"))}.base">{_num(r.get("base"))}</td>'
        f'<td data-k="published.{_e(r.get("version"))}.bytes">{_num(r.get("bytes"))}</td>'
        f'<td data-k="published.{_e(r.get("version"))}.full_bytes">{_num(r.get("full_bytes"))}</td>'
        f'<td>{_share(r.get("bytes"), r.get("full_bytes"))}</td><td>{_e(r.get("dtype") or "-")}</td></tr>'
        for r in rows)
    return ('<table id="published"><tr><th>version</th><th>kind</th><th>base</th><th>bytes that travel</th>'
            f'<th>full weights</th><th>share</th><th>dtype</th></tr>{body}</table>')


def _verdicts(verdicts: dict[str, dict[str, int]], prefix: str) -> str:
    parts = []
    for outcome in ("accepted", "rejected_hard", "rejected_soft"):
        for reason, n in sorted((verdicts.get(outcome) or {}).items()):
            label = outcome if reason == outcome else f"{outcome}: {reason}"
            parts.append(f'<span class="verdict {outcome}" data-k="{prefix}verdict.{_e(outcome)}.{_e(reason)}" '
                         f'data-value="{_e(n)}">{_e(label)} {_e(n)}</span>')
    return " ".join(parts) or "-"


def render(data: dict[str, Any]) -> str:
    t = data.get("trainer", {})
    rewards = t.get("reward") or []
    last = rewards[-1]["reward_mean"] if rewards and isinstance(rewards[-1].get("reward_mean"), int | float) else None
    totals = data["totals"]
    chain = data["chain"]
    prop = data["propagation"]
    node_rows = []
    for n in data["nodes"]:
        c = n.get("chain") or {}
        stake = c.get("stake")
        key = f"node.{_e(n['address'])}."
        node_rows.append(
            f'<tr data-node="{_e(n["address"])}"><td>{_e(n["name"])}</td><td title="{_e(n["address"])}">'
            f'{_e(_short(n["address"]))}</td>'
            f'<td data-k="{key}status">{_e(c.get("status", "-"))}</td>'
            f'<td data-k="{key}state" class="{"up" if n["up"] else "down"}">{_e(n.get("state") or ("up" if n["up"] else "down"))}</td>'
            f'<td data-k="{key}stake" data-value="{_e(stake) if stake is not None else ""}">'
            f'{_num(stake / TOKEN, 2) if isinstance(stake, int) else "-"}</td>'
            f'<td data-k="{key}accepted_units">{_num(c.get("accepted_units"))}</td>'
            f'<td data-k="{key}policy_version">{_num(n.get("policy_version"))}</td>'
            f'<td data-k="{key}accepted" data-value="{_e(n["accepted"])}">{_e(n["accepted"])}</td>'
            f'<td data-k="{key}pending">{_e(n["pending"])}</td>'
            f'<td>{_verdicts(n["verdicts"], key)}</td>'
            f'<td data-k="{key}p50">{_num(n["propagation"]["p50_s"], 2)}</td>'
            f'<td data-k="{key}p99">{_num(n["propagation"]["p99_s"], 2)}</td></tr>')
    val_rows = "".join(
        f'<tr data-validator="{_e(v["address"])}"><td>{_e(v["name"])}</td><td title="{_e(v["address"])}">'
        f'{_e(_short(v["address"]))}</td><td class="{"up" if v["up"] else "down"}">{"up" if v["up"] else "down"}</td>'
        + "".join(f'<td data-k="validator.{_e(v["address"])}.{k}">{_e(v["counts"].get(k, "-"))}</td>'
                  for k in ("received", "accepted", "rejected_hard", "rejected_soft", "pending"))
        + "</tr>" for v in data["validators"])
    event_rows = "".join(
        f'<tr><td>{_e(e.get("block"))}</td><td>{_e(e.get("name"))}</td><td class="args">'
        f'{_e(", ".join(f"{k}={_short(str(a))}" for k, a in (e.get("args") or {}).items()))}</td></tr>'
        for e in chain.get("recent", [])[:12])
    event_counts = " ".join(f'<span data-k="events.{_e(k)}" data-value="{_e(n)}">{_e(k)} {_e(n)}</span>'
                            for k, n in sorted(chain.get("events", {}).items()))
    run = data.get("run") or {}
    split = (data.get("published") or {}).get("split") or {}
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><meta http-equiv="refresh" content="{REFRESH_S}">
<title>prime-devnet: {_e(run.get("run_id", ""))}</title>
<style>
body{{font:14px/1.4 system-ui,sans-serif;margin:16px;color:#212121;background:#fafafa}}
h1{{font-size:20px;margin:0 0 8px}} h2{{font-size:16px;margin:18px 0 6px}}
.tiles{{display:flex;gap:12px;flex-wrap:wrap}} .tile{{background:#fff;border:1px solid #ddd;border-radius:6px;padding:8px 12px}}
.tile b{{display:block;font-size:20px}} .grid{{display:grid;grid-template-columns:repeat(auto-fit,minmax(560px,1fr));gap:12px}}
.card{{background:#fff;border:1px solid #ddd;border-radius:6px;padding:10px}}
table{{border-collapse:collapse;background:#fff}} td,th{{border-bottom:1px solid #eee;padding:3px 8px;text-align:left}}
svg text{{font-size:11px;fill:#555}} .axis{{stroke:#999}} .line{{fill:none;stroke:#1565c0;stroke-width:2}}
#reward-chart circle{{fill:#1565c0}} .up{{color:#2e7d32}} .down{{color:#c62828;font-weight:bold}}
.verdict{{display:inline-block;padding:0 5px;border-radius:3px;margin:1px;color:#fff}}
.accepted{{background:#2e7d32}} .delta{{color:#1565c0}} .anchor{{color:#555}} .rejected_hard{{background:#c62828}} .rejected_soft{{background:#ef6c00}}
.key{{display:inline-block;width:10px;height:10px;margin:0 3px 0 8px}} .empty{{color:#777}} .args{{font-family:monospace;font-size:12px}}
</style></head><body>
<h1>prime-devnet · run {_e(run.get("run_id", "-"))} · {_e(data.get("model", ""))} · {_e(run.get("env", ""))}</h1>
<div class="tiles">
<div class="tile">trainer step<b data-k="trainer.step">{_num(t.get("step"))}</b>of {_num(t.get("max_steps"))}</div>
<div class="tile">latest reward<b data-k="trainer.reward">{_num(last)}</b>{len(rewards)} steps</div>
<div class="tile">chain policy version<b data-k="chain.policy_version">{_num(chain.get("policy_version"))}</b>{"chain up" if chain.get("up") else "chain DOWN"}</div>
<div class="tile">submissions<b data-k="totals.received">{_e(totals["received"])}</b>received by the validators</div>
<div class="tile">accepted<b data-k="totals.accepted">{_e(totals["accepted"])}</b>hard <span data-k="totals.rejected_hard">{_e(totals["rejected_hard"])}</span> · soft <span data-k="totals.rejected_soft">{_e(totals["rejected_soft"])}</span> · pending <span data-k="totals.pending">{_e(totals["pending"])}</span></div>
<div class="tile">versions as deltas<b data-k="published.deltas">{_num(split.get("deltas"))}</b>of <span data-k="published.versions">{_num(split.get("versions"))}</span> · <span data-k="published.share">{_share(split.get("bytes"), split.get("full_bytes"))}</span> of the full bytes travel</div>
<div class="tile">version to node<b data-k="propagation.p50">{_num(prop["p50_s"], 2)} s</b>p50 · p99 <span data-k="propagation.p99">{_num(prop["p99_s"], 2)}</span> s ({_e(prop["samples"])})</div>
</div>
<div class="grid">
<div class="card"><h2>Reward per trainer step</h2>{reward_chart(rewards)}</div>
<div class="card"><h2>Submissions over time (validators' ledgers)</h2>{submissions_chart(data["submissions"])}</div>
<div class="card"><h2>Seconds from a version's signing to each node's first batch at it</h2>{propagation_chart(data["nodes"])}</div>
<div class="card"><h2>Weights published: bytes per version (origin's store)</h2>{published_table(data.get("published") or {})}</div>
<div class="card"><h2>Recent chain events</h2><p>{event_counts or "none yet"}</p>
<table><tr><th>block</th><th>event</th><th>arguments</th></tr>{event_rows}</table></div>
</div>
<h2>Nodes</h2>
<table id="nodes"><tr><th>node</th><th>address</th><th>on chain</th><th>loop</th><th>stake</th><th>accepted units</th>
<th>version</th><th>accepted</th><th>pending</th><th>verdicts by reason</th><th>p50 s</th><th>p99 s</th></tr>
{"".join(node_rows)}</table>
<h2>Validators</h2>
<table id="validators"><tr><th>validator</th><th>address</th><th>API</th><th>received</th><th>accepted</th>
<th>hard</th><th>soft</th><th>pending</th></tr>{val_rows}</table>
<p class="empty">Generated <span data-k="generated_at" data-value="{data["generated_at"]:.3f}">{_e(time.strftime("%H:%M:%S", time.localtime(data["generated_at"])))}</span>;
refreshes every {REFRESH_S} s. JSON: <a href="/api/dashboard">/api/dashboard</a> · <a href="/api/audit">/api/audit</a>.
Propagation counts versions after the first (v0 reaches a node when it joins).</p>
</body></html>
"""
