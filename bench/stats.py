"""Summaries of samples, and the rows of the results table."""
import math


def percentile(sorted_values, q):
    """Linear-interpolated percentile (q in 0..100) of already sorted values."""
    if not sorted_values:
        return None
    if len(sorted_values) == 1:
        return sorted_values[0]
    pos = (len(sorted_values) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def summary(values):
    """{n, min, median, p99, mean, max} of a list of numbers (None if empty)."""
    if not values:
        return None
    s = sorted(values)
    return {"n": len(s), "min": s[0], "median": percentile(s, 50), "p99": percentile(s, 99),
            "mean": sum(s) / len(s), "max": s[-1]}


def ms(seconds_list):
    return [x * 1000.0 for x in seconds_list]


class Row:
    """One line of the table: a figure through cellblock against its baseline."""

    def __init__(self, figure, name, unit, cellblock=None, baseline=None, baseline_name="",
                 ratio_on="median", target="", met=None, note="", detail="",
                 higher_is_better=False):
        self.figure = figure
        self.name = name
        self.unit = unit
        self.cellblock = cellblock        # summary dict, or None
        self.baseline = baseline          # summary dict, or None
        self.baseline_name = baseline_name
        self.ratio_on = ratio_on          # which statistic the ratio compares
        self.target = target
        self.met = met                    # True / False / None (no target)
        self.note = note                  # short, shown in the table
        self.detail = detail              # where the time goes etc., shown under the table
        self.higher_is_better = higher_is_better

    @property
    def ratio(self):
        if not self.cellblock or not self.baseline:
            return None
        b = self.baseline.get(self.ratio_on)
        c = self.cellblock.get(self.ratio_on)
        if not b or c is None:
            return None
        return c / b

    def to_json(self):
        return {"figure": self.figure, "name": self.name, "unit": self.unit,
                "cellblock": self.cellblock, "baseline": self.baseline,
                "baseline_name": self.baseline_name, "ratio": self.ratio,
                "ratio_on": self.ratio_on, "target": self.target, "met": self.met,
                "note": self.note, "detail": self.detail}


def unavailable(figure, name, reason):
    """A row saying a figure could not be measured, and why (never a made-up number)."""
    return Row(figure, name, "", note=f"not available: {reason}", met=None)


def fmt(value, unit):
    if value is None:
        return "–"
    if unit in ("ms",):
        return f"{value:.2f}" if value < 100 else f"{value:.0f}"
    if unit in ("MB",):
        return f"{value:.1f}"
    if unit in ("exec/s", "sessions"):
        return f"{value:.0f}"
    return f"{value:.3g}"


def cell(text):
    """Text safe in one Markdown table cell: no line breaks, no bare pipes."""
    return " / ".join(part.strip() for part in str(text).splitlines() if part.strip()) \
        .replace("|", "\\|")


def triple(s, unit):
    if not s:
        return "–"
    return f"{fmt(s['min'], unit)} / {fmt(s['median'], unit)} / {fmt(s['p99'], unit)}"


def markdown_details(rows):
    lines = []
    for r in rows:
        if r.detail:
            lines.append(f"- **{r.figure}. {cell(r.name)}**: {cell(r.detail)}")
    return "\n".join(lines)


def markdown_table(rows):
    lines = ["| # | figure | unit | cellblock min / median / p99 | baseline min / median / p99 "
             "| ratio | target | met? |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        name = cell(r.name + (f" — {r.note}" if r.note else ""))
        base = triple(r.baseline, r.unit)
        if r.baseline_name and r.baseline:
            base = f"{base} ({r.baseline_name})"
        elif r.baseline_name:
            base = r.baseline_name
        ratio = r.ratio
        ratio_text = "–" if ratio is None else f"{ratio:.2f}× ({r.ratio_on})"
        if ratio is not None and 0 < ratio < 0.1:
            ratio_text = f"{ratio:.4f}× ({r.ratio_on}; {1 / ratio:.0f}× faster)"
        met = "–" if r.met is None else ("yes" if r.met else "**no**")
        lines.append(f"| {r.figure} | {name} | {r.unit or '–'} | {triple(r.cellblock, r.unit)} "
                     f"| {base} | {ratio_text} | {r.target or '–'} | {met} |")
    return "\n".join(lines)
