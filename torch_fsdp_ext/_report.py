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
    if "upstream" in fix.details.get("replays", fix.details.get("parts", {})).values():
        return "partly"
    return "yes"


def plugin_does(fix: Any) -> str:
    """What the fix does on this torch, in a few words."""
    if not fix.needed:  # nothing installed: what torch does itself, or why the fix stands aside
        return fix.reason
    if "strategy" in fix.details:
        return f"strategy {fix.details['strategy']}"
    parts = fix.details.get("parts")
    if parts:
        ours = [what for what, who in parts.items() if who == "torch_fsdp_ext"]
        torch_own = [what for what, who in parts.items() if who == "upstream"]
        return f"fixes {', '.join(ours)}" + (f" (torch: {', '.join(torch_own)})" if torch_own else "")
    replays = fix.details.get("replays")
    if not replays:
        return ""
    ours = [what for what, who in replays.items() if who == "torch_fsdp_ext"]
    torch_own = [what for what, who in replays.items() if who != "torch_fsdp_ext"]
    return f"replays {', '.join(ours)}" + (f" (torch: {', '.join(torch_own)})" if torch_own else "")


NEEDED_LEGEND = "needed: yes = this torch has the failure; partly = torch repairs part, the plugin the rest; no = nothing to fix"


def repaired_by(fix: Any) -> tuple[list[str], list[str]]:
    """The parts (reduce) or replays (recompute) of a fix that the plugin repairs, and those torch repairs itself."""
    who = fix.details.get("parts") or fix.details.get("replays") or {}
    return [what for what, by in who.items() if by == "torch_fsdp_ext"], [
        what for what, by in who.items() if by == "upstream"
    ]


def listed(items: list[str]) -> str:
    """``["input cast", "output cast"]`` -> ``"the input cast and the output cast"``."""
    named = [f"the {item}" for item in items]
    return " and ".join(named) if len(named) < 3 else ", ".join(named[:-1]) + " and " + named[-1]


def why_sentences(fix: Any) -> list[str]:
    """Whether this torch needs the fix and why, and what the plugin does, a sentence a line."""
    if fix.needed is None:
        return [f"{fix.name}: not installed: {fix.reason}."]
    if not fix.needed:
        return [f"{fix.name}: not needed: {fix.reason}."]
    parts = fix.details.get("parts")
    if parts:
        ours = [what for what, who in parts.items() if who == "torch_fsdp_ext"]
        torch_own = [what for what, who in parts.items() if who == "upstream"]
        does = f"{fix.name}: the plugin fixes {listed(ours)}."
        if not torch_own:
            return [f"{fix.name}: needed, because {fix.reason}.", does]
        return [f"{fix.name}: needed in part: this torch fixes {listed(torch_own)} itself.", does]
    replays = fix.details.get("replays")
    if not replays:
        return [f"{fix.name}: needed, because {fix.reason}."]
    # Note: where torch does part itself, what is replayed by whom says more than the probe's reason.
    ours = [what for what, who in replays.items() if who == "torch_fsdp_ext"]
    torch_own = [what for what, who in replays.items() if who != "torch_fsdp_ext"]
    does = f"{fix.name}: the plugin replays {listed(ours)}."
    if not torch_own:
        return [f"{fix.name}: needed, because {fix.reason}.", does]
    return [f"{fix.name}: needed in part: during recompute this torch replays {listed(torch_own)} itself.", does]


def status_text(report: Any) -> str:
    lines = [f"torch_fsdp_ext on torch {report.torch_version}"]
    if not report.supported:
        unsupported = [fix.name for fix in report.fixes.values() if fix.needed is None and fix.reason.startswith(
            "unsupported torch")]
        if len(unsupported) == len(report.fixes):
            lines.append("Unsupported torch, nothing is patched: " + "; ".join(report.missing) + ".")
        else:
            lines.append(f"Torch internals are missing ({'; '.join(report.missing)}): the fix(es) "
                         f"{', '.join(unsupported)} stand aside, the others work.")
    rows = [["fix", "needed", "active", "strategy", "wrapped torch methods"]]
    for fix in report.fixes.values():
        rows.append(
            [fix.name, needed_word(fix), "yes" if fix.active else "no", fix.details.get("strategy", "-"),
             str(len(fix.wraps))]
        )
    lines.append(format_table(rows))
    for fix in report.fixes.values():
        lines.extend(why_sentences(fix))
        upcast = fix.details.get("upcast")
        if upcast and upcast["params"]:
            lines.append(
                f"{fix.name}: so far this process upcast {upcast['params']} parameter(s), adding "
                f"{upcast['bytes']:,} bytes of fp32 master weights on this rank."
            )
        if fix.details.get("reduce_dtype") == "float32":
            lines.append(f"{fix.name}: in fp32 where a policy's reduce_dtype is unset or 16-bit (the setting).")
        elif "reduce_dtype" in fix.details:
            lines.append(f"{fix.name}: in each policy's reduce_dtype; TORCH_FSDP_EXT_REDUCE_DTYPE=float32: fp32.")
        if fix.armed:
            where = ", ".join(dict.fromkeys(".".join(symbol.split(".")[:3]) for symbol in fix.armed))
            lines.append(f"{fix.name}: armed: {len(fix.armed)} more outside FSDP2 ({where}) from the first fully_shard.")
        if fix.details.get("not_covered"):
            not_covered = ", ".join(fix.details["not_covered"])
            lines.append(f"{fix.name}: not covered, since they were grouped and sharded before install: {not_covered}.")
    return "\n".join(lines)
