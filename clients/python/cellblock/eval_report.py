"""`cellblock eval`'s report: the JSON's encoder and the HTML page (every
notebook's verdict, each cell's outcome, outputs and images)."""
import base64
import html
import json
import os

IMAGE_MIMES = ("image/png", "image/jpeg", "image/gif")

def json_default(value):
    if isinstance(value, bytes):
        return base64.b64encode(value).decode()
    return str(value)


def _images(outputs):
    """(mime, base64) of each image output, checked to be base64."""
    out = []
    for o in outputs:
        for mime in IMAGE_MIMES:
            value = o.get("data", {}).get(mime)
            if isinstance(value, list):
                value = "".join(value)
            if isinstance(value, str):
                try:
                    out.append((mime, base64.b64encode(base64.b64decode(value)).decode()))
                except ValueError:
                    pass
    return out


def _short(text, limit=4000):
    return text if len(text) <= limit else text[:limit] + f"\n… ({len(text) - limit} more characters)"


CSS = """
body{font:14px/1.45 system-ui,sans-serif;margin:2em auto;max-width:1200px;color:#222;padding:0 1em}
h1{margin-bottom:.2em} table{border-collapse:collapse;margin:.6em 0;width:100%}
th,td{border:1px solid #ddd;padding:3px 7px;text-align:left;vertical-align:top;font-size:13px}
th{background:#f4f4f4} .pass{color:#17702d;font-weight:600} .fail{color:#b3151b;font-weight:700}
.error{color:#8a4b00;font-weight:700} tr.bad td{background:#fff1f1}
pre{background:#f7f7f7;border:1px solid #e3e3e3;padding:6px 8px;overflow-x:auto;white-space:pre-wrap;
margin:.3em 0;font-size:12px} img{max-width:640px;border:1px solid #ddd;margin:4px 0}
details{margin:.8em 0;border:1px solid #ddd;border-radius:4px;padding:.3em .8em}
summary{cursor:pointer;font-weight:600} .muted{color:#777} .num{text-align:right}
"""


def _verdict_span(verdict):
    return f'<span class="{html.escape(verdict)}">{html.escape(verdict)}</span>'


def _mb(b):
    return f"{b / 2**20:.0f}" if b else ""


def write_html(report, path):
    e = html.escape
    s = report["summary"]
    parts = ["<!doctype html><html><head><meta charset='utf-8'><title>cellblock eval</title>",
             f"<style>{CSS}</style></head><body>",
             "<h1>cellblock eval</h1>",
             f"<p>{e(report['finished_at'])} · {s['notebooks']} notebooks · {s['cells']} cells · "
             f"{report['duration_s']:.1f} s · parallel {report['options']['parallel']} · server "
             f"{e(report['server'].get('version', '?'))} ({'embedded' if report['server']['embedded'] else e(report['server']['manager'])})</p>",
             f"<p style='font-size:1.3em'>{s['as_declared']} of {s['notebooks']} notebooks as declared: "
             f"{_verdict_span('pass' if s['not_as_declared'] == 0 else 'fail')}</p>",
             "<table><tr><th>notebook</th><th>declared</th><th>verdict</th><th>as declared</th>"
             "<th>cells as declared</th><th>failing cells</th><th>time (s)</th><th>peak MB</th>"
             "<th>session</th></tr>"]
    for nb in report["notebooks"]:
        failing = [str(c["index"] + 1) for c in nb["cells"] if not c["passed"]]
        parts.append(
            f"<tr class='{'' if nb['as_declared'] else 'bad'}'><td><a href='#{e(nb['name'])}'>"
            f"{e(nb['name'])}</a></td><td>{e(nb['declared'])}</td><td>{_verdict_span(nb['verdict'])}</td>"
            f"<td>{'yes' if nb['as_declared'] else '<b>no</b>'}</td>"
            f"<td class='num'>{nb['cells_passed']}/{nb['cells_total']}</td><td>{e(', '.join(failing))}</td>"
            f"<td class='num'>{nb['duration_s']:.1f}</td><td class='num'>{_mb(nb['peak_memory_bytes'])}</td>"
            f"<td class='muted'>{e(nb['session_id'] or '')}</td></tr>")
    parts.append("</table>")
    for nb in report["notebooks"]:
        parts.append(f"<details id='{e(nb['name'])}'{'' if nb['as_declared'] else ' open'}>"
                     f"<summary>{e(nb['name'])}: {_verdict_span(nb['verdict'])} "
                     f"(declared {e(nb['declared'])}) — {nb['cells_passed']}/{nb['cells_total']} cells "
                     f"as declared</summary>")
        parts.append(f"<p class='muted'>{e(nb['path'])} → <a href='{e(nb['executed'])}'>"
                     f"{e(nb['executed'])}</a>; limits {e(json.dumps(nb['limits']))}</p>")
        if nb["error"]:
            parts.append(f"<p class='error'>could not run: {e(nb['error'])}</p>")
        parts.append("<table><tr><th>#</th><th>outcome</th><th>expected</th><th>as declared</th>"
                     "<th>wall ms</th><th>cpu ms</th><th>peak MB</th><th>left</th><th>output</th></tr>")
        for c in nb["cells"]:
            got = c["outcome"] + (f" {c['ename']}" if c.get("ename") else "")
            cell_parts = [f"<pre>{e(_short(c['text'], 600))}</pre>" if c["text"].strip() else ""]
            if not c["passed"]:
                cell_parts.insert(0, f"<div class='fail'>{e('; '.join(c['mismatches']))}</div>"
                                     f"<pre>{e(_short(c['source']))}</pre>")
            for mime, b64 in _images(c["outputs"]):
                cell_parts.append(f"<img alt='{e(mime)}' src='data:{e(mime)};base64,{b64}'>")
            parts.append(
                f"<tr class='{'' if c['passed'] else 'bad'}'><td>{c['index'] + 1}</td><td>{e(got)}</td>"
                f"<td>{e(json.dumps(c['expect'])) if c['expect'] else '<span class=muted>ok</span>'}</td>"
                f"<td>{_verdict_span('pass' if c['passed'] else 'fail')}</td>"
                f"<td class='num'>{c['wall_ms'] if c['wall_ms'] is not None else ''}</td>"
                f"<td class='num'>{c['cpu_ms'] if c['cpu_ms'] is not None else ''}</td>"
                f"<td class='num'>{_mb(c['memory_peak_bytes'])}</td>"
                f"<td class='num'>{c['executions_left'] if c['executions_left'] is not None else ''}</td>"
                f"<td>{''.join(cell_parts)}</td></tr>")
        parts.append("</table>")
        if nb["fetched"]:
            parts.append("<p>files fetched from /data/output:</p><ul>")
            for f in nb["fetched"]:
                if "error" in f:
                    parts.append(f"<li class='fail'>{e(f['path'])}: {e(f['error'])}</li>")
                    continue
                parts.append(f"<li><a href='{e(f['local'])}'>{e(f['path'])}</a> ({f['size']} bytes, "
                             f"sha256 {e(f['sha256'][:16])}…)</li>")
                if f["path"].lower().endswith(".png"):
                    with open(os.path.join(os.path.dirname(path), f["local"]), "rb") as fh:
                        b64 = base64.b64encode(fh.read()).decode()
                    parts.append(f"<img alt='{e(f['path'])}' src='data:image/png;base64,{b64}'>")
            parts.append("</ul>")
        parts.append("</details>")
    parts.append("</body></html>\n")
    with open(path, "w") as f:
        f.write("".join(parts))


# ---------------------------------------------------------------- the command
