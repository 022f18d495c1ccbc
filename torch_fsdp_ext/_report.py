"""Plain-text tables for ``str(status())``, ``python -m torch_fsdp_ext status`` and ``doctor``."""

from __future__ import annotations

from typing import Any


def format_table(rows: list[list[str]]) -> str:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows)


def needed_word(fix: Any) -> str:
    """``yes``, ``no``, ``partly`` (this torch repairs part of the failure itself) or ``unsupported``."""
    if fix.needed is None:
        return "unsupported"
    if not fix.needed:
        return "no"
    if "upstream" in fix.details.get("replays", {}).values():
        return "partly"
    return "yes"


def plugin_does(fix: Any) -> str:
    """What the fix does on this torch, in a few words."""
    if not fix.needed:  # nothing installed: what torch does itself, or why the fix stands aside
        return fix.reason
    if "strategy" in fix.details:
        return f"strategy {fix.details['strategy']}"
    replays = fix.details.get("replays")
    if not replays:
        return ""
    ours = [what for what, who in replays.items() if who == "torch_fsdp_ext"]
    torch_own = [what for what, who in replays.items() if who != "torch_fsdp_ext"]
    return f"replays {', '.join(ours)}" + (f" (torch: {', '.join(torch_own)})" if torch_own else "")


NEEDED_LEGEND = "needed: yes = this torch has the failure; partly = torch repairs part, the plugin the rest; no = nothing to fix"


def status_text(report: Any) -> str:
    lines = [f"torch_fsdp_ext on torch {report.torch_version}"]
    if not report.supported:
        unsupported = [fix.name for fix in report.fixes.values() if fix.needed is None and fix.reason.startswith(
            "unsupported torch")]
        if len(unsupported) == len(report.fixes):
            lines.append("unsupported torch, nothing patched: " + "; ".join(report.missing))
        else:
            lines.append(f"torch internals missing: {'; '.join(report.missing)}; fix(es) {', '.join(unsupported)} "
                         "stand aside, the others work")
    rows = [["fix", "needed", "active", "strategy", "wrapped torch methods"]]
    for fix in report.fixes.values():
        rows.append(
            [fix.name, needed_word(fix), "yes" if fix.active else "no", fix.details.get("strategy", "-"),
             str(len(fix.wraps))]
        )
    lines.append(format_table(rows))
    for fix in report.fixes.values():
        # Without a fix in place its reason (the line above) says it all.
        does = "" if "strategy" in fix.details or not fix.needed else plugin_does(fix)
        lines.append(f"{fix.name}: {fix.reason}")
        if does:
            lines.append(f"{fix.name}: the plugin {does}")
        upcast = fix.details.get("upcast")
        if upcast and upcast["params"]:
            lines.append(
                f"{fix.name}: upcast so far in this process: {upcast['params']} parameter(s), "
                f"+{upcast['bytes']:,} bytes of fp32 master weights on this rank"
            )
        if fix.details.get("not_covered"):
            not_covered = ", ".join(fix.details["not_covered"])
            lines.append(f"{fix.name}: not covered (grouped, sharded before install): {not_covered}")
    return "\n".join(lines)
