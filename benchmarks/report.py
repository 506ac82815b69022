"""Render the benchmark results: markdown tables, acceptance verdicts and PNG plots.

Run it after the benchmarks::

    python benchmarks/report.py [--results benchmarks/results]

It reads ``p2p_vs_gloo.json`` (written by ``benchmarks/p2p_vs_gloo.py``) and ``netns_dsgd.json``
(written by ``benchmarks/netns_dsgd.py``), ``netns_hier.json`` (``benchmarks/netns_hier.py``) and
``security_cost.json`` (``benchmarks/security_cost.py``; any of them may be missing or say
``skipped``), writes
``REPORT.md`` with every table and the acceptance table of all criteria, writes
``README_TABLE.md`` (a compact table to paste into the README) and prints that table.

``p2p_vs_gloo.py`` uses the same functions (:func:`render_p2p`, :func:`plot_sizes`,
:func:`plot_resnet`, :func:`acceptance`) for its own ``p2p_vs_gloo.md`` and PNGs, so the JSON is
the single source of every number shown. Only the standard library and matplotlib are needed.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # `python benchmarks/report.py` puts only benchmarks/ on it
    sys.path.insert(0, str(REPO))

from benchmarks.hivemind_avg import OTHER_PEER_FAILED  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"

#: per-size series measured by p2p_vs_gloo.py, in table order
OPS: dict[str, str] = {
    "gloo": "gloo all_reduce (in place)",
    "nar_": "decent neighbor_allreduce_ (in place; a private tensor, copied in and out)",
    "nar": "decent neighbor_allreduce (new tensor)",
    "ar_": "decent allreduce_ (in place)",
    "tcp_exchange": "raw TCP exchange (both ways at once)",
    "tcp_oneway": "raw TCP one-way 0->1",
    "oneway": "decent one-way 0->1 (neighbor_allreduce_ with dst_weights)",
    "nar_reg": "decent neighbor_allreduce_ on a share_memory_() tensor (registered: no copies)",
    "oneway_reg": "decent one-way 0->1 on share_memory_() tensors (the daemons' bulk path "
                  "without worker copies)",
}
#: decent ops among OPS (the ones whose results are checked against the closed form)
DECENT_OPS = ("nar_", "nar", "ar_", "oneway", "nar_reg", "oneway_reg")
#: ResNet-18 list variants
RN_OPS: dict[str, str] = {
    "gloo_list": "gloo: all_reduce(async_op=True) per tensor, wait all",
    "gloo_flat": "gloo: flatten into one buffer, one all_reduce, copy back",
    "nar_list": "decent: neighbor_allreduce_async_ per tensor, wait all (fused)",
    "ar_list": "decent: allreduce_async_ per tensor, wait all (fused)",
    "nar_list_reg": "decent: neighbor_allreduce_async_ per share_memory_() tensor, wait all",
}
STYLE: dict[str, tuple[str, str, str]] = {  # series -> (marker, linestyle, color)
    "gloo": ("o", "-", "tab:orange"),
    "nar_": ("s", "-", "tab:blue"),
    "nar": ("D", ":", "tab:blue"),
    "ar_": ("^", "-", "tab:cyan"),
    "tcp_exchange": ("x", "--", "black"),
    "tcp_oneway": ("+", "--", "tab:gray"),
    "oneway": ("v", "-.", "tab:brown"),
    "nar_reg": ("h", "-", "tab:purple"),
    "oneway_reg": ("<", "-.", "tab:pink"),
    "hm_allreduce": ("*", "-", "tab:green"),
    "hm_step": ("P", ":", "tab:olive"),
}
HM_TITLES = {
    "hm_allreduce": "hivemind DecentralizedAverager all-reduce only",
    "hm_step": "hivemind DecentralizedAverager step() (matchmaking incl.)",
}
#: netns_hier.py's targets (its JSON carries its own; these name them when it is missing)
HIER_ROWS = (("4h", "gloo_over_hier", 1.6, "gloo ring allreduce / hierarchical D-SGD step"),
             ("4f", "flat_over_hier", 1.7,
              "flat one-peer D-SGD over workers / hierarchical D-SGD step"))
#: security_cost.py's ratios to insecure (its JSON carries the targets: at most 1.05x for the
#: authenticated modes without bulk encryption, none for bulk over TLS: reported)
SECURITY_ROWS = (("9s", "secret_over_insecure", "secret (HMAC handshakes, bulk in clear)"),
                 ("9m", "mtls_clear_over_insecure", "mtls, bulk in clear"),
                 ("9t", "mtls_tls_over_insecure", "mtls, bulk over TLS"))
SECURITY_TARGET = 1.05
MIB64 = 64 << 20
KIB4 = 4 << 10
LOAD_WARNING = 1.5


# ------------------------------------------------------------------------------ formatting


def human_bytes(n: float) -> str:
    """``4 KiB``, ``16 MiB``... (binary units)."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if float(n).is_integer() else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def ms(seconds: float | None) -> str:
    """Seconds as milliseconds with sensible precision; ``-`` for a missing value."""
    if seconds is None or not math.isfinite(seconds):
        return "-"
    v = seconds * 1e3
    return f"{v:.3f}" if v < 1 else f"{v:.2f}" if v < 100 else f"{v:.0f}"


def gbps(nbytes: float, seconds: float | None) -> str:
    """Throughput in GB/s (decimal) of ``nbytes`` moved in ``seconds``."""
    if seconds is None or not math.isfinite(seconds) or seconds <= 0:
        return "-"
    return f"{nbytes / seconds / 1e9:.3f}"


def ratio_text(value: float | None, digits: int = 2) -> str:
    """``1.23x``, or ``-``."""
    return "-" if value is None or not math.isfinite(value) else f"{value:.{digits}f}x"


def mib(n: float | None) -> str:
    """Bytes as ``12.3 MiB``."""
    return "-" if n is None else f"{n / (1 << 20):.1f} MiB"


def table(header: Sequence[str], rows: Sequence[Sequence[str]], align: str = "") -> list[str]:
    """A markdown table; ``align`` has one ``l``/``r`` per column (default: first left)."""
    align = align or "l" + "r" * (len(header) - 1)
    lines = ["| " + " | ".join(header) + " |",
             "|" + "|".join(":---" if a == "l" else "---:" for a in align) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return lines


# ------------------------------------------------------------------------------ accessors


def median(entry: dict[str, Any], op: str) -> float | None:
    """The reported median of ``op`` in a size (or ResNet-18) entry; None if it failed/missing."""
    s = entry.get("stats", {}).get(op)
    if not s:
        return None
    v = s.get("median")
    return float(v) if v is not None and math.isfinite(v) else None


def ratio_to(entry: dict[str, Any], op: str, base: str = "gloo") -> float | None:
    """``median(op) / median(base)`` in the same entry."""
    a, b = median(entry, op), median(entry, base)
    return a / b if a is not None and b else None


def size_entry(p2p: dict[str, Any], nbytes: int) -> dict[str, Any] | None:
    """The per-size entry for exactly ``nbytes``."""
    for e in p2p.get("sizes", []):
        if int(e["nbytes"]) == nbytes:
            return dict(e)
    return None


def hivemind_rows(p2p: dict[str, Any]) -> list[dict[str, Any]]:
    """hivemind result rows (empty when skipped or failed)."""
    hm = p2p.get("hivemind") or {}
    return list(hm.get("results", [])) if isinstance(hm, dict) else []


def hivemind_state(p2p: dict[str, Any]) -> str:
    """``ok``, or why there are no hivemind numbers."""
    hm = p2p.get("hivemind")
    if not hm:
        return "not run (--no-hivemind or --quick)"
    if "skipped" in hm:
        return f"skipped: {hm['skipped']}"
    if "error" in hm:  # often a traceback: its last line says what failed, on one table row
        lines = [ln.strip() for ln in str(hm["error"]).splitlines() if ln.strip()]
        return f"failed: {lines[0]} ... {lines[-1]}" if len(lines) > 1 else f"failed: {hm['error']}"
    return "ok"


def hivemind_case(p2p: dict[str, Any], case: str) -> dict[str, Any] | None:
    """The hivemind row for ``case`` (``resnet18`` or ``float32x<numel>``)."""
    for r in hivemind_rows(p2p):
        if r.get("case") == case:
            return r
    return None


def op_status(entry: dict[str, Any], op: str) -> str:
    """``""`` when ``op`` ran and was exact, else a short marker."""
    if entry.get("failures", {}).get(op):
        return "FAILED"
    if not entry.get("ok", {}).get(op, True):
        return "WRONG"
    return ""


def cell(entry: dict[str, Any], op: str) -> str:
    """Median ms of ``op``, marked when it failed or was wrong."""
    flag = op_status(entry, op)
    if flag == "FAILED":
        return "**FAILED**"
    return ms(median(entry, op)) + (" **WRONG**" if flag else "")


# ------------------------------------------------------------------------------ acceptance


def _verdict(value: float | None, target: float, at_least: bool) -> bool | None:
    if value is None:
        return None
    return value >= target if at_least else value <= target


def _vs(res: dict[str, Any], ratio: float, timing: str = "") -> str:
    """``1.68x (371 vs 221 ms, steal 0%; CPU 0.99 vs 1.47 s per GB sent)`` for a netns result;
    ``timing="_barrier"``: the barrier-timed medians, without the steal and CPU."""
    text = (f"{ratio_text(ratio)} ({ms(res['gloo' + timing]['median_s'])} vs "
            f"{ms(res['decent' + timing]['median_s'])} ms")
    if timing:
        return text + ")"
    per_gb = cpu_per_gb(res)
    return text + f", steal {res.get('steal_frac', 0):.0%}" + (
        f"; CPU {per_gb[0]:.2f} vs {per_gb[1]:.2f} s per GB sent)" if per_gb else ")")


def cpu_text(entry: dict[str, Any], op: str) -> str:
    """``; CPU 1.92 vs 1.10 s per GB`` for a loopback size whose calls counted their CPU (both
    workers and their daemons for decent, both workers for gloo; per GB of the tensor)."""
    cpu = entry.get("cpu_s_per_call", {})
    if op not in cpu or "gloo" not in cpu:
        return ""
    gb = entry["nbytes"] / 1e9
    return f"; CPU {cpu[op] / gb:.2f} vs {cpu['gloo'] / gb:.2f} s per GB"


def cpu_per_gb(res: dict[str, Any]) -> tuple[float, float] | None:
    """CPU seconds (every process of the run) per GB the ranks sent, gloo's and decent's, for a
    netns D-SGD result: a gloo ring allreduce sends 2 (n - 1) / n models per rank, a one-peer
    D-SGD step one. None when the run did not record its CPU."""
    n, model = int(res.get("nodes", 0)), float(res.get("mbytes", 0)) * 1e6
    try:
        gloo_cpu = statistics.median(res["gloo"]["cpu_s_per_repeat"])
        decent_cpu = statistics.median(res["decent"]["cpu_s_per_repeat"])
    except (KeyError, statistics.StatisticsError):
        return None
    if n < 2 or model <= 0:
        return None
    gloo_gb, decent_gb = n * 2 * (n - 1) / n * model / 1e9, n * model / 1e9
    return gloo_cpu / gloo_gb, decent_cpu / decent_gb


def _hier_vs(res: dict[str, Any], key: str) -> str:
    """``1.70x (371 vs 218 ms; 43.9 vs 25.1 MB/link/step, steal 0%)`` for a netns_hier ratio."""
    slow, fast = (res["systems"][k] for k in key.split("_over_"))
    return (f"{ratio_text(res['targets'][key]['value'])} ({ms(slow['median_s'])} vs "
            f"{ms(fast['median_s'])} ms; {slow['bytes']['link_tx_mb_mean']:.1f} vs "
            f"{fast['bytes']['link_tx_mb_mean']:.1f} MB/link/step, steal "
            f"{res.get('steal_frac', 0):.0%})")


def wrong_is_fail(row: dict[str, Any], res: dict[str, Any]) -> None:
    """A row whose results were wrong fails, however fast, and says so."""
    if not res.get("correct", True):
        row["pass"] = False
        row["measured"] += "; results WRONG"


def provenance(res: dict[str, Any], main: dict[str, Any]) -> str:
    """``; from <commit>, <date>`` unless ``res`` was measured at the same clean commit as
    ``main`` (a variant's JSON may be left from an older run; a modified tree cannot be told
    apart by its commit)."""
    commit = res.get("decent_source", {}).get("repo_commit")
    if commit and commit == main.get("decent_source", {}).get("repo_commit") and \
            "modified" not in commit:
        return ""
    return f"; from {commit or 'an unknown commit'}, {res.get('date', 'undated')}"


def acceptance(p2p: dict[str, Any] | None, netns: dict[str, Any] | None,
               pngs: Sequence[Path] = (), results: Path | None = None) -> list[dict[str, Any]]:
    """One row per acceptance criterion: id, criterion, measured text, value, target, pass.

    ``pass`` is True/False, or None when the number is missing (not measured, skipped, failed).
    ``netns`` None leaves the netns criterion out (``p2p_vs_gloo.md`` does not cover it); the
    netns variants (rows 4', 4o) come from their JSON in ``results``, when given.
    """
    rows: list[dict[str, Any]] = []

    def add(cid: str, criterion: str, value: float | None, target: float, at_least: bool,
            measured: str, unit: Callable[[float], str] = ratio_text) -> None:
        op = ">=" if at_least else "<="
        shown = unit(target)
        rows.append({"id": cid, "criterion": criterion, "value": value,
                     "measured": measured if value is not None else measured or "not measured",
                     "target": shown if shown == "reported" else f"{op} {shown}",
                     "pass": _verdict(value, target, at_least)})

    def pct(v: float) -> str:
        return f"{v * 100:.0f}%"

    def ratio_rows(entry: dict[str, Any], label: str, target: float,
                   specs: tuple[tuple[str, str, str], ...]) -> None:
        """One row per (id, op, what): the op's median over gloo's in ``entry`` (starred rows
        only when measured)."""
        for cid, op, what in specs:
            if cid[-1] in "*'" and op not in entry.get("repeats", {}):
                continue
            r = ratio_to(entry, op)
            add(cid, label.format(what), r, target, False,
                f"{ratio_text(r)} ({ms(median(entry, op))} vs {ms(median(entry, 'gloo'))} ms"
                f"{cpu_text(entry, op)})" if r is not None else _why(entry, op))

    p2p = p2p or {}
    big = size_entry(p2p, MIB64)
    small = size_entry(p2p, KIB4)
    # (1) bulk transfer vs raw TCP, 64 MiB neighbor_allreduce vs gloo
    if big is not None:
        raw = median(big, "tcp_oneway")
        for cid, op, what in (
                ("1a", "oneway_reg", "share_memory_() tensors: the daemons' path, no worker "
                                     "copies"),
                ("1a'", "oneway", "private tensors, copied into and out of the arena")):
            dec = median(big, op)
            if cid.endswith("'") and op not in big.get("repeats", {}) and not op_status(big, op):
                continue
            share = raw / dec if raw and dec else None
            add(cid, f"peer bulk transfer (one-way 64 MiB, {what}) vs raw TCP, same script",
                share, 0.70, True, f"{pct(share)} ({gbps(MIB64, dec)} vs {gbps(MIB64, raw)} GB/s)"
                if share is not None else _why(big, op), pct)
        ratio_rows(big, "64 MiB {} / gloo allreduce", 1.0,
                   (("1b", "nar_reg", "neighbor_allreduce_ on a share_memory_() tensor"),
                    ("1b'", "nar_", "neighbor_allreduce_ on a private tensor (copies)"),
                    ("1c", "nar", "out-of-place neighbor_allreduce(x).wait() on a private "
                                  "tensor (the README's first call)")))
    else:
        add("1a", "peer bulk transfer (one-way 64 MiB) vs raw TCP", None, 0.70, True,
            "64 MiB not measured", pct)
        add("1b", "64 MiB neighbor_allreduce_ / gloo allreduce", None, 1.0, False,
            "64 MiB not measured")
    # (2) small ops
    if small is not None:
        ratio_rows(small, "4 KiB {} end to end / gloo allreduce", 2.0,
                   (("2", "nar_", "neighbor_allreduce_"),
                    ("2'", "ar_", "allreduce_")))
        ratio_rows(small, "4 KiB {} end to end / gloo allreduce", 1.5,
                   (("2c", "nar", "out-of-place neighbor_allreduce(x).wait()"),))
    else:
        add("2", "4 KiB neighbor_allreduce_ / gloo allreduce", None, 2.0, False,
            "4 KiB not measured")
    # (3) ResNet-18 list
    rn = p2p.get("resnet18")
    if rn:
        dec = median(rn, "nar_list")
        for cid, op, base in (("3a", "nar_list", "gloo_list"), ("3a'", "nar_list", "gloo_flat"),
                              ("3a*", "nar_list_reg", "gloo_list")):
            if cid.endswith("*") and op not in rn.get("repeats", {}):
                continue
            r = ratio_to(rn, op, base)
            what = "decent nar step" + (" (share_memory_() tensors)" if "reg" in op else "")
            add(cid, f"ResNet-18 list (62 tensors) {what} / {base.replace('_', ' ')}",
                r, 1.2, False,
                f"{ratio_text(r)} ({ms(median(rn, op))} vs {ms(median(rn, base))} ms)"
                if r is not None else _why(rn, op))
        hm = hivemind_case(p2p, "resnet18")
        for cid, key, what in (("3b", "step_s", "step()"),
                               ("3b'", "allreduce_s", "all-reduce only")):
            v = hm[key] / dec if hm and dec else None
            add(cid, f"ResNet-18: hivemind {what} / decent nar step (speedup)", v, 3.0, True,
                f"{ratio_text(v, 1)} ({ms(hm[key])} vs {ms(dec)} ms)" if v is not None and hm
                else f"hivemind {hivemind_state(p2p)}" if not hm else _why(rn, "nar_list"))
    else:
        add("3a", "ResNet-18 list decent / gloo", None, 1.2, False, "not measured")
        add("3b", "ResNet-18 hivemind step() / decent", None, 3.0, True, "not measured")
    # (4) netns
    if netns is not None:
        if "skipped" in netns or "speedup" not in netns:
            why = netns.get("skipped") or netns.get("error") or "no result"
            add("4", "8 netns at 1 Gbit/s, 25 MB: gloo ring allreduce / one-peer D-SGD step",
                None, 1.6, True, f"not measured ({why})")
        else:
            v = float(netns["speedup"])
            add("4", f"{netns.get('nodes')} netns at {netns.get('rate')}, "
                f"{netns.get('mbytes')} MB: gloo ring allreduce / one-peer D-SGD step "
                f"({netns.get('decent_mode', 'copy')})", v, 1.6,
                True, _vs(netns, v) + (f"; {tried}" if (tried := attempts_text(netns)) else ""))
            wrong_is_fail(rows[-1], netns)
            if "speedup_barrier" in netns:
                v = float(netns["speedup_barrier"])
                add("4b", "the same, each call timed from the rank's barrier exit (reported; "
                    "row 4 times every rank from one common start)", v, 1.6, True,
                    _vs(netns, v, "_barrier"))
                wrong_is_fail(rows[-1], netns)
        for row, file, what in (
                ("4'", "netns_dsgd_inplace.json",
                 "the same, D-SGD step in place on a private tensor (copies)"),
                ("4o", "netns_dsgd_optimizer.json",
                 "the same as an update: DecentralizedOptimizer(SGD, dsgd).step() / gloo "
                 "all_reduce of the gradients (one bucket, not overlapped with backward) + "
                 "SGD.step()")):
            other = None if results is None else load(results / file)
            if other is not None and "speedup" in other:
                v = float(other["speedup"])
                add(row, what, v, 1.6, True, _vs(other, v) + provenance(other, netns))
                wrong_is_fail(rows[-1], other)
        hier = None if results is None else load(results / "netns_hier.json")
        for cid, key, target, what in HIER_ROWS:
            if hier is None or "targets" not in hier:
                why = "netns_hier.json missing" if hier is None else \
                    hier.get("skipped") or hier.get("error") or "no result"
                add(cid, f"4 netns x 2 workers at 1gbit, 25 MB: {what}", None, target, True,
                    f"not measured ({why})")
                continue
            t = hier["targets"][key]
            add(cid, f"{hier['nodes']} netns x {hier['per_node']} workers at {hier['rate']}, "
                f"{hier['mbytes']} MB: {what}", float(t["value"]), float(t["target"]), True,
                _hier_vs(hier, key) + provenance(hier, netns))
            wrong_is_fail(rows[-1], hier)
    # (9) what security costs (loopback, every mode in one run)
    if results is not None:
        security_rows(rows, load(results / "security_cost.json"), netns or {})
        optimizer_rows(add, load(results / "optimizer_step.json"))
        ddp_rows(add, load(results / "ddp_loopback.json"), load(results / "ddp_netns.json"))
        tf = load(results / "tf_vs_torch.json")
        add("7t", "64 MiB neighbor_allreduce(x) of the TensorFlow client / the torch client, same "
            "tensor, same run", None if tf is None else float(tf["ratio"]), 1.3, False,
            "not measured (tf_vs_torch.json)" if tf is None else
            f"{ratio_text(float(tf['ratio']))} ({tf['tf_ms']:.1f} vs {tf['torch_ms']:.1f} ms); "
            f"from {commit_of(tf)}")
    rows.append(memory_row(p2p.get("daemons") or []))
    # (6) report and plots
    have = [p for p in pngs if p.exists()]
    rows.append({"id": "6", "criterion": "markdown report + PNG plots (each also as ratio to gloo)",
                 "value": None, "target": "written",
                 "measured": ", ".join(p.name for p in have) or "no PNG",
                 "pass": bool(pngs) and len(have) == len(pngs)})
    # exactness of every decent result
    wrong = [f"{human_bytes(e['nbytes'])} {op}" for e in p2p.get("sizes", [])
             for op in DECENT_OPS if op_status(e, op)]
    if rn:
        wrong += [f"ResNet-18 {op}" for op in ("nar_list", "ar_list", "nar_list_reg")
                  if op_status(rn, op)]
    rows.append({"id": "-", "criterion": "every decent result equals the closed form exactly",
                 "value": None, "target": "exact", "measured": "all exact" if not wrong
                 else "failed/wrong: " + ", ".join(wrong), "pass": not wrong and bool(p2p)})
    return rows


def security_rows(rows: list[dict[str, Any]], sec: dict[str, Any] | None,
                  main: dict[str, Any]) -> None:
    """Rows 9s, 9m (at most 1.05x insecure) and 9t (reported) from ``security_cost.json``;
    a wrong result fails its row, however fast."""
    res = sec or {}
    why = ("security_cost.json missing" if sec is None else
           str(res.get("error") or res.get("skipped") or "no result"))
    for cid, key, what in SECURITY_ROWS:
        r = res.get("ratios", {}).get(key)
        target = (r or {}).get("target", None if cid == "9t" else SECURITY_TARGET)
        row: dict[str, Any] = {
            "id": cid, "value": None, "measured": f"not measured ({why})", "pass": None,
            "criterion": f"64 MiB neighbor_allreduce_, 2 daemons, share_memory_(): {what} / "
                         "insecure" + ("" if target is not None else
                                       " (reported: the cost of encrypting the bulk path)"),
            "target": "reported (no target)" if target is None else f"<= {ratio_text(target)}"}
        if r is not None:
            m, base = res["modes"][r["mode"]], res["modes"]["insecure"]
            row["value"] = r["value"]
            row["measured"] = (f"{ratio_text(r['value'], 3)} ({ms(m['median_s'])} vs "
                               f"{ms(base['median_s'])} ms; {m['gbps']:.2f} vs "
                               f"{base['gbps']:.2f} GB/s; per-round ratios' median "
                               f"{ratio_text(r['paired_median'], 3)})" + provenance(res, main))
            row["pass"] = True if target is None else r["value"] <= target
            wrong_is_fail(row, res)
        rows.append(row)


def security_lines(sec: dict[str, Any] | None, results: Path) -> list[str]:
    """Summary of ``security_cost.json``: every mode's 64 MiB call, ratios to insecure."""
    if sec is None:
        return ["`security_cost.json` is missing: `benchmarks/security_cost.py` has not been run."]
    if "ratios" not in sec:
        return [f"Not measured: {sec.get('error') or sec.get('skipped') or 'no result'}."]
    ratios = {r["mode"]: r for r in sec["ratios"].values()}
    rows = []
    for mode, m in sec["modes"].items():
        r = ratios.get(mode)
        label = mode if m["label"] == mode else f"{mode}: {m['label']}"
        rows.append([label, f"{ms(m['median_s'])} ({ms(m['p10_s'])}-"
                     f"{ms(m['p90_s'])})", f"{m['gbps']:.2f}",
                     ratio_text(r["value"], 3) if r else "1",
                     ratio_text(r["paired_median"], 3) if r else "1",
                     f"{m['daemon_cpu_ms_per_call']:.0f}", "yes" if m["correct"] else "NO"])
    verdict = "; ".join(
        f"{r['mode']} / insecure **{r['value']:.3f}x** ("
        + (f"target <= {r['target']}x: {'met' if r['met'] else 'MISSED'})"
           if r["target"] is not None else "reported)") for r in sec["ratios"].values())
    png = ["", "![security cost](security_cost.png)"] \
        if (results / "security_cost.png").exists() else []
    return [
        f"{human_bytes(sec['nbytes'])} float32 `neighbor_allreduce_` on `share_memory_()` "
        f"tensors between 2 daemons on loopback, in each security mode; {sec['repeats']} timed "
        f"calls per mode after {sec['warmup']} untimed rounds. Method: {sec['method']}. "
        "Ratios: a mode's median over insecure's; per-round: the median of each call over "
        "insecure's call of the same round. Daemon CPU: both daemons, per call. Load average "
        f"at start {_load(sec.get('loadavg_start'))}, 64 MiB memmove {_memmove(sec)}, CPU stolen "
        f"{sec.get('steal_frac', 0):.0%}; date {sec.get('date')}; decent "
        f"{sec.get('decent_source', {}).get('repo_commit', '?')}.",
        "",
        *table(["mode", "median ms (p10-p90)", "GB/s", "/ insecure", "per-round ratio",
                "daemon CPU ms/call", "exact"], rows),
        "",
        f"Ratios: {verdict}.",
        *png,
    ]


def _why(entry: dict[str, Any], op: str) -> str:
    text = entry.get("failures", {}).get(op)
    if text:
        return f"{op} FAILED: {text.splitlines()[0][:160]}"
    return f"{op} not measured"


def commit_of(res: dict[str, Any]) -> str:
    """The commit a result was measured at (``decent_source``), or ``?``."""
    src = res.get("decent_source")
    return str(src.get("repo_commit", "?")) if isinstance(src, dict) else str(src or "?")


def optimizer_rows(add: Callable[..., None], opt: dict[str, Any] | None) -> None:
    """Rows 3o, 3g, 3k, 3kg: a general-path optimizer step against the same algorithm's
    flattened step (D-SGD: flatten=True; gradient tracking: the same bytes in one parameter, its
    ratio to a flattened D-SGD step given too; Keras: its D-SGD and gradient-tracking steps on
    variables of the same sizes, against torch's)
    (``optimizer_step.json``; loopback, 2 ranks)."""
    rows = (("3o", "general", "flat", "D-SGD / flattened D-SGD step"),
            ("3g", "gt", "gt1", "gradient tracking / gradient tracking on the same bytes in one "
                                "parameter (its flattened layout)"),
            ("3k", "keras", "flat", "the Keras wrapper's compiled D-SGD step / the torch "
                                    "flattened D-SGD step"),
            ("3kg", "keras_gt", "gt1", "the Keras wrapper's compiled gradient-tracking step / "
                                       "the torch one-parameter gradient-tracking step"))
    for cid, key, base, what in rows:
        if opt is None or key not in opt or base not in opt:
            add(cid, f"optimizer step, general path, {what}", None, 1.3, False,
                "not measured (optimizer_step.json)")
            continue
        v = opt[key]["wall_ms"] / opt[base]["wall_ms"]
        text = f"{ratio_text(v)} ({opt[key]['wall_ms']:.1f} vs {opt[base]['wall_ms']:.1f} ms)"
        if base != "flat":
            text += (f"; {ratio_text(opt[key]['wall_ms'] / opt['flat']['wall_ms'])} a flattened "
                     "D-SGD step (a second exchange and more math)")
        if key.startswith("keras") and "keras_sgd_ms" in opt:
            text += f"; the plain Keras SGD step alone {opt['keras_sgd_ms']:.1f} ms"
        add(cid, f"{opt['mbytes']:g} MB optimizer step, general path (flatten=False), {what}",
            v, 1.3, False, f"{text}; from {commit_of(opt)}")


def ddp_rows(add: Callable[..., None], loop: dict[str, Any] | None,
             netns: dict[str, Any] | None) -> None:
    """Rows 10l, 10n, 10d, 10t, 10b: DDP of ResNet-18 over the ``decent`` backend against gloo
    (``ddp_loopback.json``, ``ddp_netns.json``: ``benchmarks/ddp_vs_gloo.py``)."""
    def steps(res: dict[str, Any], a: str, b: str) -> str:
        med = res["step_median_s"]
        return (f"{med[a] * 1e3:.0f} vs {med[b] * 1e3:.0f} ms, {res['ranks']} ranks, "
                f"{res.get('setting', '')}")
    specs = (("10l", loop, "decent_over_gloo", 1.1, False, "decent", "gloo",
              "DDP step of ResNet-18 over decent / over gloo, 2 daemons on loopback"),
             ("10n", netns, "decent_over_gloo", 1.0, False, "decent", "gloo",
              "DDP step of ResNet-18 over decent / over gloo, 8 netns at 1 Gbit/s"),
             ("10d", netns, "decentralized_speedup", 1.6, True, "gloo", "decentralized",
              "DDP over gloo / DDP in decent's decentralized mode (one-peer CTA D-SGD), 8 netns"))
    for cid, res, key, target, at_least, a, b, what in specs:
        if res is None or key not in res:
            add(cid, what, None, target, at_least, "not measured (benchmarks/ddp_vs_gloo.py)")
            continue
        where = ddp_breakdown_text(res) if cid != "10d" else ""
        add(cid, what, float(res[key]), target, at_least,
            f"{ratio_text(float(res[key]))} ({steps(res, a, b)}; {res['date']}){where}")
    if loop is not None and "allreduce_4kib_median_us" in loop:
        lat = loop["allreduce_4kib_median_us"]
        add("10t", "4 KiB all_reduce latency, decent / gloo, 2 daemons on loopback (reported)",
            float(loop["allreduce_4kib_decent_over_gloo"]), math.inf, False,
            f"{ratio_text(float(loop['allreduce_4kib_decent_over_gloo']))} "
            f"({lat['decent']:.0f} vs {lat['gloo']:.0f} us)", lambda _: "reported")
    if netns is not None and "broadcast_buffers_median_us" in netns:
        lat = netns["broadcast_buffers_median_us"]
        ratio = float(netns["broadcast_buffers_decent_over_gloo"])
        add("10b", "DDP's per-step buffer broadcast (BatchNorm statistics, one per dtype), "
            "decent / gloo, slowest rank, 8 netns (reported)", ratio, math.inf, False,
            f"{ratio_text(ratio)} ({lat['decent']:.0f} vs {lat['gloo']:.0f} us)",
            lambda _: "reported")


def ddp_breakdown_text(res: dict[str, Any]) -> str:
    """Where decent's DDP step differs from gloo's: the backward phase and the CPU that moving
    the gradients took (runs before the breakdown was recorded: nothing)."""
    if "phases_ms" not in res or not res.get("cpu_ms_per_step", {}).get("gloo"):
        return ""
    back = {name: res["phases_ms"][name]["backward"] for name in ("decent", "gloo")}
    mover = res["cpu_ms_per_step"]["decent"]["daemons"]
    gloo = res["cpu_ms_per_step"]["gloo"]["gloo threads"]
    return (f"; backward {back['decent']:.0f} vs {back['gloo']:.0f} ms; CPU per step moving "
            f"the gradients (user + system, all ranks): decent's daemons {mover[0]:.0f} + "
            f"{mover[1]:.0f} ms, gloo's threads {gloo[0]:.0f} + {gloo[1]:.0f} ms")


def acceptance_lines(rows: list[dict[str, Any]]) -> list[str]:
    """The acceptance table as markdown."""
    verdict = {True: "**PASS**", False: "**FAIL**", None: "n/a"}
    return table(["#", "criterion", "measured", "target", "result"],
                 [[r["id"], r["criterion"], r["measured"], r["target"], verdict[r["pass"]]]
                  for r in rows], "lllll")


# ------------------------------------------------------------------------------ p2p markdown


def _memmove(result: dict[str, Any]) -> str:
    """The host's 64 MiB copy time recorded with a run (``hostprobe``), or that it was not."""
    value = result.get("memmove_64mib_ms")
    return "not recorded" if value is None else f"{value:.1f} ms"


def environment_lines(meta: dict[str, Any]) -> list[str]:
    """Command, machine, versions, load."""
    v = meta.get("versions", {})
    load0 = meta.get("loadavg_start", [0.0])[0]
    lines = [
        f"- command: `{meta.get('command')}`",
        f"- date: {meta.get('date')}; total runtime {meta.get('runtime_s', 0):.0f} s",
        f"- machine: {meta.get('nproc')} CPUs ({meta.get('cpu')}), {meta.get('platform')}",
        "- versions: " + ", ".join(f"{k} {val}" for k, val in v.items())
        + f"; git {meta.get('git')} at start"
        + (f", {meta['git_end']} at end" if meta.get("git_end", meta.get("git")) != meta.get("git")
           else ""),
        f"- load average (1/5/15 min) at start: {_load(meta.get('loadavg_start'))}, at end: "
        f"{_load(meta.get('loadavg_end'))}",
        f"- memory: a 64 MiB copy took {_memmove(meta)} at start (compare hosts by this first)",
        f"- settings: torch threads {meta.get('threads')}, warm-up calls {meta.get('warmup')}, "
        f"timing {meta.get('mode')}, budget {meta.get('budget')} s per op and size"
        + (", --quick" if meta.get("quick") else ""),
    ]
    if meta.get("placement", "none") != "none":
        cpus = meta.get("pinned_cpus", {})
        lines.append(f"- placement `{meta['placement']}`: rank 0 on CPU {cpus.get('rank')}, "
                     f"its daemon on CPU {cpus.get('daemon')} (every thread pinned)")
    if load0 > LOAD_WARNING:
        lines.append(f"- **note: load average {load0:.2f} > {LOAD_WARNING} at start: other "
                     "processes were using the CPUs; every ratio compares numbers taken "
                     "interleaved in the same run, but absolute times are inflated**")
    return lines


def _load(values: Sequence[float] | None) -> str:
    return " / ".join(f"{x:.2f}" for x in values) if values else "-"


def size_table(p2p: dict[str, Any]) -> list[str]:
    """Main per-size table: medians, ratios to gloo, raw TCP, one-way throughput."""
    rows = []
    for e in p2p.get("sizes", []):
        n = int(e["nbytes"])
        raw, one, reg = median(e, "tcp_oneway"), median(e, "oneway"), median(e, "oneway_reg")
        rows.append([
            human_bytes(n), cell(e, "gloo"),
            cell(e, "nar_"), ratio_text(ratio_to(e, "nar_")),
            cell(e, "nar"), ratio_text(ratio_to(e, "nar")),
            cell(e, "ar_"), ratio_text(ratio_to(e, "ar_")),
            cell(e, "nar_reg"), ratio_text(ratio_to(e, "nar_reg")),
            cell(e, "tcp_exchange"), ratio_text(ratio_to(e, "tcp_exchange")),
            gbps(n, raw), gbps(n, one) if not op_status(e, "oneway") else cell(e, "oneway"),
            f"{raw / one * 100:.0f}%" if raw and one else "-",
            gbps(n, reg) if reg else "-", f"{raw / reg * 100:.0f}%" if raw and reg else "-",
        ])
    return table(["size", "gloo ms", "nar_ ms", "/gloo", "nar_ copied ms", "/gloo", "nar ms",
                  "/gloo", "allreduce_ ms",
                  "/gloo", "nar_ registered ms", "/gloo", "raw TCP exchange ms", "/gloo",
                  "raw one-way GB/s", "decent one-way GB/s", "% of raw",
                  "registered one-way GB/s", "% of raw"], rows)


def detail_table(p2p: dict[str, Any]) -> list[str]:
    """Every series: median (p10-p90), min, repeats, max abs error."""
    rows = []
    for e in p2p.get("sizes", []):
        for op in OPS:
            s = e.get("stats", {}).get(op)
            err = e.get("errors", {}).get(op)
            rows.append([
                human_bytes(int(e["nbytes"])), op,
                f"{ms(s['median'])} ({ms(s['p10'])}-{ms(s['p90'])})" if s else cell(e, op),
                ms(s["min"]) if s else "-",
                gbps(int(e["nbytes"]), s["median"]) if s else "-",
                ratio_text(ratio_to(e, op)),
                str(e.get("repeats", {}).get(op, "-")),
                "-" if err is None else f"{err:.1e}" + (" WRONG" if op_status(e, op) else ""),
            ])
    return table(["size", "series", "median ms (p10-p90)", "min ms", "GB/s", "/gloo", "R",
                  "max abs err"], rows)


def resnet_lines(p2p: dict[str, Any]) -> list[str]:
    """ResNet-18 table (decent and gloo variants, hivemind) with ratios to both gloo variants."""
    rn = p2p.get("resnet18")
    if not rn:
        return ["ResNet-18 list: not measured."]
    head = (f"{rn['tensors']} float32 tensors, {rn['numel']:,} values ({mib(rn['nbytes'])}), "
            "one step = the whole list averaged once; median ms per step, max over ranks.")
    rows = []
    gl, gf = median(rn, "gloo_list"), median(rn, "gloo_flat")
    for op, title in RN_OPS.items():
        m = median(rn, op)
        rows.append([title, cell(rn, op), gbps(rn["nbytes"], m),
                     ratio_text(m / gl if m and gl else None),
                     ratio_text(m / gf if m and gf else None),
                     str(rn.get("repeats", {}).get(op, "-"))])
    hm = hivemind_case(p2p, "resnet18")
    for key, title in (("allreduce_s", "hivemind DecentralizedAverager: all-reduce only"),
                       ("step_s", "hivemind DecentralizedAverager: step() (matchmaking incl.)")):
        m = hm[key] if hm else None
        rows.append([title, ms(m) if hm else hivemind_state(p2p), gbps(rn["nbytes"], m),
                     ratio_text(m / gl if m and gl else None),
                     ratio_text(m / gf if m and gf else None),
                     str(hm["repeats"]) if hm else "-"])
    return [head, "", *table(["variant", "ms / step", "GB/s", "/ gloo list", "/ gloo flat", "R"],
                             rows)]


def hivemind_lines(p2p: dict[str, Any]) -> list[str]:
    """hivemind results next to decent's and gloo's numbers from the same run."""
    state = hivemind_state(p2p)
    if state != "ok":
        return [f"hivemind: {state}."]
    hm = p2p["hivemind"]
    settings = hm.get("settings", {})
    lines = [f"hivemind {hm.get('hivemind')} `DecentralizedAverager`, 2 peers on loopback, run by "
             "rank 0 in a subprocess after decent and gloo were done (rank 1 idle at a gloo "
             f"barrier); min_matchmaking_time {settings.get('min_matchmaking_time_s')} s, "
             f"{settings.get('statistic', '')}. step() = what a user sees (matchmaking "
             "included); all-reduce = after the group was formed.", ""]
    rows = []
    for r in hivemind_rows(p2p):
        if r["case"] == "resnet18":
            e: dict[str, Any] | None = p2p.get("resnet18")
            gloo_key, dec_key, label = "gloo_list", "nar_list", "ResNet-18 list"
        else:
            e = size_entry(p2p, int(r["bytes"]))
            gloo_key, dec_key, label = "gloo", "nar_", human_bytes(int(r["bytes"]))
        g = median(e, gloo_key) if e else None
        d = median(e, dec_key) if e else None
        rows.append([label, ms(r["allreduce_s"]), ms(r["step_s"]), ms(r["matchmaking_s"]),
                     ms(d), ms(g),
                     ratio_text(r["allreduce_s"] / g if g else None, 1),
                     ratio_text(r["step_s"] / g if g else None, 1),
                     ratio_text(r["step_s"] / d if d else None, 1),
                     ratio_text(r["allreduce_s"] / d if d else None, 1),
                     "yes" if r.get("correct") else "NO"])
    lines += table(["case", "hm all-reduce ms", "hm step() ms", "hm matchmaking ms",
                    "decent nar ms", "gloo ms", "hm all-reduce / gloo", "hm step / gloo",
                    "hm step / decent", "hm all-reduce / decent", "exact"], rows)
    failed = [r for r in hivemind_rows(p2p) if r.get("failed_rounds")]
    if failed:
        lines += ["", "hivemind rounds that failed and were started over with a new averager "
                  "(not timed): " + "; ".join(
                      f"{r['case']}: {r['failed_rounds']} ("
                      + ", ".join(sorted({f['error'] for fs in r.get('failures', {}).values()
                                          for f in fs if f['error'] != OTHER_PEER_FAILED}))
                      + ")" for r in failed) + "."]
    return lines


def own_memory(mem: dict[str, int]) -> int | None:
    """A daemon's own resident memory: VmRSS less the workers' shared memory it maps (arena
    pages and registered tensors, resident in the workers too)."""
    if "VmRSS" not in mem:
        return None
    return mem["VmRSS"] - mem.get("RssShmem", 0)


def memory_row(daemons: list[dict[str, Any]]) -> dict[str, Any]:
    """Row 5: each daemon's own memory (:func:`own_memory`) at the end of the loopback run, once
    its receive pool is back at its floor, against its start (target <= 1.5x); VmRSS with the
    shared pages is reported beside it."""
    pairs = [(own_memory(d.get("start", {})), own_memory(d.get("end", {}))) for d in daemons]
    known = bool(pairs) and all(s and e for s, e in pairs)
    worst = max(e / s for s, e in pairs if s and e) if known else None

    def text(d: dict[str, Any], own: tuple[int | None, int | None]) -> str:
        s, p, e = d["start"], d["peak"], d["end"]
        return (f"rank {d['rank']}: own {mib(own[0])} -> {mib(own[1])} "
                f"({(own[1] or 0) / max(1, own[0] or 0):.2f}x); VmRSS with the workers' shared "
                f"pages: start {mib(s.get('VmRSS'))}, peak {mib(p.get('VmRSS'))}, end "
                f"{mib(e.get('VmRSS'))}")

    return {"id": "5", "criterion": "daemon memory at the end of the loopback run (idle, receive "
            "pool back at its floor) / at its start: VmRSS less the workers' shared memory",
            "value": worst, "target": f"<= {ratio_text(1.5)}",
            "measured": "; ".join(text(d, own) for d, own in zip(daemons, pairs, strict=True))
            if known else "not available",
            "pass": None if worst is None else worst <= 1.5}


def daemon_lines(p2p: dict[str, Any]) -> list[str]:
    """Daemon memory (start, peak sampled every 50 ms, end) and counters."""
    daemons = p2p.get("daemons") or []
    if not daemons:
        return ["Daemon memory: not available."]
    rows = []
    for d in daemons:
        s, pk, en = d.get("start", {}), d.get("peak", {}), d.get("end", {})
        rows.append([str(d["rank"]), str(d.get("pid")),
                     f"{mib(s.get('VmRSS'))} ({mib(s.get('RssAnon'))} / {mib(s.get('RssShmem'))})",
                     f"{mib(pk.get('VmRSS'))} ({mib(pk.get('RssAnon'))} / "
                     f"{mib(pk.get('RssShmem'))})",
                     f"{mib(en.get('VmRSS'))} ({mib(en.get('RssAnon'))} / "
                     f"{mib(en.get('RssShmem'))})",
                     mib(en.get("VmHWM")), str(d.get("samples", 0)),
                     ", ".join(f"{k} {mib(v)}" for k, v in d.get("phase_peak_rss", {}).items()),
                     mib(d.get("status", {}).get("pool_bytes")),
                     mib(d.get("status", {}).get("pool_peak_bytes")),
                     str(d.get("status", {}).get("ops_completed", "-")),
                     str(d.get("status", {}).get("ops_failed", "-"))])
    return ["Daemon memory: VmRSS (RssAnon / RssShmem) from /proc/PID/status, sampled every "
            "50 ms in each worker; RssShmem counts the touched pages of the shared-memory arenas.",
            "Receive pool: buffers the daemon holds at the end / most in use at once "
            "(`client.status()`).",
            "", *table(["rank", "pid", "start", "peak", "end", "VmHWM", "samples",
                        "peak RSS per phase", "receive pool", "pool peak", "ops done",
                        "ops failed"], rows)]


def failure_lines(p2p: dict[str, Any]) -> list[str]:
    """Every failed decent op with the error text."""
    out = []
    entries = [(human_bytes(int(e["nbytes"])), e) for e in p2p.get("sizes", [])]
    if p2p.get("resnet18"):
        entries.append(("ResNet-18", p2p["resnet18"]))
    for label, e in entries:
        for op, text in e.get("failures", {}).items():
            if text:
                flat = " | ".join(text.strip().splitlines())[:600]
                out.append(f"- {label} `{op}` raised: `{flat}`")
        for op, text in e.get("mismatches", {}).items():
            if text:
                out.append(f"- {label} `{op}` WRONG result: "
                           f"{' | '.join(text.strip().splitlines())[:600]}")
    return ["Failures and wrong results (error text as raised):", "", *out] if out else []


P2P_PNGS = ("p2p_vs_gloo.png", "p2p_vs_gloo_resnet18.png")


def render_p2p(p2p: dict[str, Any], out_dir: Path) -> str:
    """``p2p_vs_gloo.md``: environment, acceptance, per-size, ResNet-18, hivemind, daemons."""
    meta = p2p.get("meta", {})
    rows = acceptance(p2p, None, [out_dir / n for n in P2P_PNGS])
    lines = [
        "# decent vs gloo (and hivemind, raw TCP): 2 daemons on loopback, one run",
        "",
        *environment_lines(meta),
        "",
        "Method: both worker processes (under `decentrun -np 2`, ring topology: each rank's "
        "neighbor_allreduce result is (x0+x1)/2) also join a gloo group and open one raw TCP "
        "connection to each other. Inputs are `(arange % 1024) + rank + 1`, so every result is "
        "exact in float32 and is compared with `torch.equal` against the closed form. Times are "
        "per call; each statistic is the maximum over the 2 ranks of that rank's own statistic; "
        "ratio = series median / gloo median from the same run (> 1: slower than gloo). "
        f"Timed calls are {meta.get('mode', '')}. Throughput = tensor bytes / median time. "
        "Raw TCP one-way: rank 0 `sendall`s the bytes, rank 1 `recv_into`s a preallocated "
        "buffer and answers 1 byte; exchange: both send and receive at once (a sender thread "
        "above 64 KiB), the physical floor of a 2-peer neighbor_allreduce. Decent one-way: rank "
        "0 `neighbor_allreduce_(t, self_weight=1, src_weights={}, dst_weights=[1])`, rank 1 "
        "`neighbor_allreduce_(t, self_weight=0, src_weights={0: 1}, dst_weights=[])`.",
        "",
        "## Acceptance",
        "",
        *acceptance_lines(rows),
        "",
        "## Per size (median ms, ratio to gloo)",
        "",
        *size_table(p2p),
        "",
        "![time, throughput, ratio](p2p_vs_gloo.png)",
        "",
        "## ResNet-18 parameter list",
        "",
        *resnet_lines(p2p),
        "",
        "![ResNet-18](p2p_vs_gloo_resnet18.png)",
        "",
        "## hivemind",
        "",
        *hivemind_lines(p2p),
        "",
        "## Daemons",
        "",
        *daemon_lines(p2p),
        "",
        *failure_lines(p2p),
        "",
        "## Every series",
        "",
        *detail_table(p2p),
        "",
    ]
    return "\n".join(lines)


# ------------------------------------------------------------------------------ plots


def _size_series(p2p: dict[str, Any]) -> dict[str, tuple[list[float], list[float]]]:
    """series -> (sizes in bytes, median seconds), per-size ops and hivemind."""
    out: dict[str, tuple[list[float], list[float]]] = {}
    for op in OPS:
        pts = [(float(e["nbytes"]), median(e, op)) for e in p2p.get("sizes", [])]
        xs = [x for x, y in pts if y is not None]
        ys = [y for _, y in pts if y is not None]
        if xs:
            out[op] = (xs, ys)
    rows = [r for r in hivemind_rows(p2p) if r["case"] != "resnet18"]
    for key, col in (("hm_allreduce", "allreduce_s"), ("hm_step", "step_s")):
        if rows:
            out[key] = ([float(r["bytes"]) for r in rows], [float(r[col]) for r in rows])
    return out


def plot_sizes(p2p: dict[str, Any], path: Path) -> None:
    """Three panels vs tensor size: time (log-log), throughput (GB/s), ratio to gloo."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullLocator

    series = _size_series(p2p)
    gloo = dict(zip(*series["gloo"], strict=True)) if "gloo" in series else {}
    sizes = sorted({x for xs, _ in series.values() for x in xs})
    titles = {**OPS, **HM_TITLES}
    fig, (ax_t, ax_b, ax_r) = plt.subplots(1, 3, figsize=(19, 7.2))
    for key, (xs, ys) in series.items():
        marker, ls, color = STYLE[key]
        ax_t.plot(xs, [y * 1e3 for y in ys], marker=marker, linestyle=ls, color=color,
                  label=titles[key])
        ax_b.plot(xs, [x / y / 1e9 for x, y in zip(xs, ys, strict=True)], marker=marker,
                  linestyle=ls, color=color, label=titles[key])
        if key != "gloo" and gloo:
            pts = [(x, y / gloo[x]) for x, y in zip(xs, ys, strict=True) if x in gloo]
            if pts:
                ax_r.plot([p[0] for p in pts], [p[1] for p in pts], marker=marker,
                          linestyle=ls, color=color, label=f"{titles[key]} / gloo")
    ax_r.axhline(1.0, color="black", linestyle="--", linewidth=1)
    labels = [("time per call (ms, median, max over ranks)", "time vs size"),
              ("throughput (GB/s = bytes / median time)", "throughput vs size"),
              ("median / gloo median (same run)", "ratio to gloo (> 1: slower than gloo)")]
    for ax, (ylabel, title) in zip((ax_t, ax_b, ax_r), labels, strict=True):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("tensor size (bytes, float32)")
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
        if sizes:
            ax.set_xticks(sizes, [human_bytes(s) for s in sizes], rotation=45)
            ax.xaxis.set_minor_locator(NullLocator())
    handles, names = ax_t.get_legend_handles_labels()
    fig.legend(handles, names, loc="lower center", ncol=4, fontsize=8, frameon=False)
    meta = p2p.get("meta", {})
    fig.suptitle(f"2 daemons on loopback, {meta.get('nproc')} CPUs, load at start "
                 f"{_load(meta.get('loadavg_start'))}, decent {meta.get('git')}; the ratio "
                 "panel uses the same series (each divided by gloo's median)", fontsize=10)
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_resnet(p2p: dict[str, Any], path: Path) -> None:
    """ResNet-18 bar chart (ms per step, log scale) with ratios to both gloo variants."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rn = p2p.get("resnet18") or {}
    bars: list[tuple[str, float]] = []
    names = {"nar_list": "decent\nneighbor_allreduce", "ar_list": "decent\nallreduce",
             "nar_list_reg": "decent nar\nshare_memory_()",
             "gloo_list": "gloo\nlist (async)", "gloo_flat": "gloo\nflat buffer"}
    for op, label in names.items():
        m = median(rn, op)
        if m is not None:
            bars.append((label, m))
    hm = hivemind_case(p2p, "resnet18")
    if hm:
        bars += [("hivemind\nall-reduce", float(hm["allreduce_s"])),
                 ("hivemind\nstep()", float(hm["step_s"]))]
    gl, gf = median(rn, "gloo_list"), median(rn, "gloo_flat")
    fig, ax = plt.subplots(figsize=(10, 5.5))
    colors = ["tab:blue", "tab:cyan", "tab:purple", "tab:orange", "tab:red", "tab:green",
              "tab:olive"]
    xs = range(len(bars))
    ax.bar(list(xs), [b[1] * 1e3 for b in bars], color=colors[:len(bars)])
    for x, (_, v) in zip(xs, bars, strict=True):
        text = f"{v * 1e3:.1f} ms"
        if gl:
            text += f"\n{v / gl:.2f}x gloo list"
        if gf:
            text += f"\n{v / gf:.2f}x gloo flat"
        ax.annotate(text, (x, v * 1e3), ha="center", va="bottom", fontsize=8,
                    xytext=(0, 3), textcoords="offset points")
    ax.set_xticks(list(xs), [b[0] for b in bars])
    ax.set_yscale("log")
    ax.set_ylabel("ms per step (median, max over ranks; log scale)")
    state = hivemind_state(p2p)
    ax.set_title(f"ResNet-18 parameter list ({rn.get('tensors', 62)} tensors, "
                 f"{mib(rn.get('nbytes'))}), 2 peers on loopback"
                 + ("" if state == "ok" else f"\nhivemind {state[:80]}"), fontsize=10)
    top = max((b[1] for b in bars), default=1.0) * 1e3
    low = min((b[1] for b in bars), default=1.0) * 1e3
    ax.set_ylim(bottom=low / 4, top=top * 8)
    ax.grid(True, axis="y", which="both", alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ------------------------------------------------------------------------------ merged report


def load(path: Path) -> dict[str, Any] | None:
    """A JSON file as a dict, None if missing; ``{"error": ...}`` if unreadable."""
    if not path.exists():
        return None
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        return {"error": f"cannot read {path.name}: {exc}"}
    return data if isinstance(data, dict) else {"error": f"{path.name} is not a JSON object"}


def attempts_text(netns: dict[str, Any]) -> str:
    """The attempts a netns run made (``--attempts``) when it made more than one, else ''."""
    attempts = netns.get("attempts", [])
    if len(attempts) < 2:
        return ""
    listed = "; ".join(
        f"{k}: steal {a['steal_frac']:.0%}, {a['speedup']:.2f}x"
        + (" (this one)" if k == netns.get("attempt") else "")
        for k, a in enumerate(attempts, 1))
    return f"attempt {netns.get('attempt')} of {len(attempts)} ({listed})"


def netns_lines(netns: dict[str, Any] | None) -> list[str]:
    """Summary of the network-namespace D-SGD benchmark."""
    if netns is None:
        return ["`netns_dsgd.json` is missing: `benchmarks/netns_dsgd.py` has not been run."]
    if "skipped" in netns or "speedup" not in netns:
        return [f"Not measured: {netns.get('skipped') or netns.get('error') or 'no result'}."]
    g, d, th = netns["gloo"], netns["decent"], netns.get("theory", {})
    link = netns.get("link", {})
    rows = [
        ["gloo ring allreduce", ms(g["median_s"]), ms(th.get("ring_allreduce_s")),
         f"{g.get('cpu_cores_busy', 0):.2f}", "yes" if g.get("correct") else "NO"],
        ["decent one-peer D-SGD step", ms(d["median_s"]), ms(th.get("one_peer_step_s")),
         f"{d.get('cpu_cores_busy', 0):.2f}", "yes" if d.get("correct") else "NO"],
    ]
    return [
        f"{netns['nodes']} network namespaces on a bridge, every link limited to "
        f"{netns['rate']} both ways (tc tbf), {netns['mbytes']} MB float32 model, median of "
        f"{netns['repeats']} repeats (slowest rank each). Raw TCP check: "
        f"{link.get('single_gbit_s', float('nan')):.3f} Gbit/s one flow. Load average at start "
        f"{_load(netns.get('loadavg_start'))}, 64 MiB memmove {_memmove(netns)}; date "
        f"{netns.get('date')}; decent "
        f"{netns.get('decent_source', {}).get('repo_commit', '?')}.",
        "",
        *table(["op", "median ms", "link-only bound ms", "CPU cores busy", "exact"], rows),
        "",
        f"Speedup gloo / decent: **{netns['speedup']:.2f}x** (link-only bound "
        f"{th.get('speedup', float('nan')):.2f}x, target {netns.get('target_speedup', 1.6)}x).",
        "",
        f"CPU stolen by the hypervisor during the timed calls: {netns.get('steal_frac', 0):.0%}"
        + ("" if netns.get("quiet_host", True) else
           f" (above {netns.get('quiet_steal', 0.10):.0%}: the host, not the links, paced this "
           "run)") + ".",
        *([f"Measured again while the host was not quiet: {tried}."]
          if (tried := attempts_text(netns)) else []),
    ]


HIER_LABELS = {"gloo": "gloo ring allreduce", "flat": "decent flat one-peer D-SGD (workers)",
               "hier": "decent hierarchical D-SGD (one copy per machine)"}


def netns_hier_lines(hier: dict[str, Any] | None, results: Path) -> list[str]:
    """Summary of the hierarchical netns benchmark (``netns_hier.json``)."""
    if hier is None:
        return ["`netns_hier.json` is missing: `benchmarks/netns_hier.py` has not been run."]
    if "targets" not in hier:
        return [f"Not measured: {hier.get('skipped') or hier.get('error') or 'no result'}."]
    th = hier.get("theory", {})
    rows = []
    for name, label in HIER_LABELS.items():
        s, b = hier["systems"][name], hier["systems"][name]["bytes"]
        rows.append([label, ms(s["median_s"]), ms(th.get("step_s", {}).get(name)),
                     f"{b['link_tx_mb_mean']:.1f} (max {b['link_tx_mb_max_call']:.1f})",
                     "-" if name == "gloo" else f"{b['daemon_sent_mb_mean']:.1f}",
                     f"{s.get('cpu_cores_busy', 0):.2f}", "yes" if s.get("correct") else "NO"])
    verdict = "; ".join(
        f"{key.replace('_over_', '/')} **{t['value']:.2f}x** (target {t['target']}x, link bound "
        f"{th.get('speedups', {}).get(key) or float('nan'):.2f}x: "
        f"{'met' if t['met'] else 'MISSED'})" for key, t in hier["targets"].items())
    png = ["", "![hierarchical D-SGD](netns_hier.png)"] \
        if (results / "netns_hier.png").exists() else []
    return [
        f"{hier['nodes']} network namespaces x {hier['per_node']} workers ({hier['workers']} "
        f"workers), every link limited to {hier['rate']} both ways, {hier['mbytes']} MB float32 "
        f"model, median of {hier['repeats']} repeats (slowest rank each), the three systems' "
        "calls interleaved. MB per link: the node's veth tx counter (upload, all traffic) and "
        "the daemon's bytes sent to its peers, per node and step, mean over nodes and calls. "
        f"Raw TCP {hier.get('link', {}).get('single_gbit_s', float('nan')):.3f} Gbit/s; load "
        f"average at start {_load(hier.get('loadavg_start'))}, 64 MiB memmove "
        f"{_memmove(hier)}; CPU stolen {hier.get('steal_frac', 0):.0%}, other processes' "
        f"cores during hier's calls {hier['systems']['hier'].get('other_cores_busy', 0):.2f}; "
        f"date {hier.get('date')}; decent "
        f"{hier.get('decent_source', {}).get('repo_commit', '?')}.",
        "",
        *table(["system", "median ms", "link-only bound ms", "MB/link/step (veth tx)",
                "daemon MB/step", "CPU cores busy", "exact"], rows),
        "",
        f"Speedups: {verdict}.",
        *png,
    ]


def readme_table(p2p: dict[str, Any] | None, netns: dict[str, Any] | None,
                 results: Path | None = None) -> str:
    """Compact markdown for the README: per-size ratios, ResNet-18, acceptance verdicts (the
    netns variants' rows from their JSON in ``results``)."""
    p2p = p2p or {}
    meta = p2p.get("meta", {})
    lines = [f"Loopback, 2 daemons, {meta.get('nproc', '?')} CPUs, decent {meta.get('git', '?')}"
             f" (load average at start {_load(meta.get('loadavg_start'))}, 64 MiB memmove "
             f"{_memmove(meta)}); median ms, "
             "ratio = decent / gloo from the same run:", ""]
    rows = []
    for e in p2p.get("sizes", []):
        n = int(e["nbytes"])
        raw, one, reg = median(e, "tcp_oneway"), median(e, "oneway"), median(e, "oneway_reg")
        rows.append([human_bytes(n), cell(e, "gloo"),
                     f"{cell(e, 'nar_')} ({ratio_text(ratio_to(e, 'nar_'))})",
                     f"{cell(e, 'ar_')} ({ratio_text(ratio_to(e, 'ar_'))})",
                     f"{cell(e, 'nar_reg')} ({ratio_text(ratio_to(e, 'nar_reg'))})",
                     ms(median(e, "tcp_exchange")),
                     " / ".join(f"{raw / v * 100:.0f}%" if raw and v else "-" for v in (reg, one))])
    lines += table(["size", "gloo allreduce", "decent neighbor_allreduce_ (private tensor)",
                    "decent allreduce_", "neighbor_allreduce_ on share_memory_()",
                    "raw TCP exchange",
                    "one-way vs raw TCP (share_memory_() / private)"], rows)
    rn = p2p.get("resnet18")
    if rn:
        hm = hivemind_case(p2p, "resnet18")
        d = median(rn, "nar_list")
        lines += ["", f"ResNet-18 list (62 tensors): decent {ms(d)} ms/step, "
                  f"{ratio_text(ratio_to(rn, 'nar_list', 'gloo_list'))} gloo list, "
                  f"{ratio_text(ratio_to(rn, 'nar_list', 'gloo_flat'))} gloo flat; "
                  + (f"hivemind step() {ms(hm['step_s'])} ms ({hm['step_s'] / d:.1f}x slower), "
                     f"all-reduce only {ms(hm['allreduce_s'])} ms" if hm and d
                     else f"hivemind {hivemind_state(p2p)}") + "."]
    rows_a = acceptance(p2p, netns if netns is not None else {"skipped": "netns_dsgd.json missing"},
                        results=results)
    verdict = {True: "PASS", False: "FAIL", None: "n/a"}
    lines += ["", *table(["#", "criterion", "measured", "target", ""],
                         [[r["id"], r["criterion"], r["measured"], r["target"],
                           verdict[r["pass"]]] for r in rows_a if r["id"] not in ("5", "6")],
                         "lllll")]
    return "\n".join(lines) + "\n"


def render_report(p2p: dict[str, Any] | None, netns: dict[str, Any] | None,
                  results: Path) -> str:
    """``REPORT.md``: acceptance over all criteria, then each benchmark's tables."""
    pngs = [results / n for n in P2P_PNGS]
    rows = acceptance(p2p, netns if netns is not None else {"skipped": "netns_dsgd.json missing"},
                      pngs if p2p else [], results)
    lines = ["# Benchmark report", "",
             "Merged from `p2p_vs_gloo.json` (`decentrun -np 2 -- python "
             "benchmarks/p2p_vs_gloo.py`), `netns_dsgd.json` (`python "
             "benchmarks/netns_dsgd.py`, as root), `netns_hier.json` (`python "
             "benchmarks/netns_hier.py`, as root), `security_cost.json` (`python "
             "benchmarks/security_cost.py`), `wan_link.md`, `wan_stripes.md`, `wan.md` and "
             "`wan_lr.md` (`make wan-link`, `make wan-stripes`, `make wan`, `make wan-lr`) by "
             "`python benchmarks/report.py`.", "",
             "## Acceptance", "", *acceptance_lines(rows), ""]
    if p2p is None or "sizes" not in p2p:
        lines += ["## Loopback (2 daemons)", "",
                  "`p2p_vs_gloo.json` is missing or unreadable"
                  + (f": {p2p['error']}" if p2p else "") + ".", ""]
    else:
        lines += ["## Loopback (2 daemons): environment", "",
                  *environment_lines(p2p.get("meta", {})), "",
                  "## Per size (median ms, ratio to gloo)", "", *size_table(p2p), "",
                  "![time, throughput, ratio](p2p_vs_gloo.png)", "",
                  "## ResNet-18 parameter list", "", *resnet_lines(p2p), "",
                  "![ResNet-18](p2p_vs_gloo_resnet18.png)", "",
                  "## hivemind", "", *hivemind_lines(p2p), "",
                  "## Daemons", "", *daemon_lines(p2p), "", *failure_lines(p2p), ""]
    lines += ["## D-SGD across network namespaces", "", *netns_lines(netns), ""]
    lines += ["## Hierarchical D-SGD across network namespaces (workers per node)", "",
              *netns_hier_lines(load(results / "netns_hier.json"), results), ""]
    lines += ["## What security costs (2 daemons on loopback, every mode in one run)", "",
              *security_lines(load(results / "security_cost.json"), results), ""]
    lines += ["## Across a WAN (emulated links with a true RTT)", "", *wan_lines(results), ""]
    if p2p is not None and "sizes" in p2p:
        lines += ["Full per-series details: `p2p_vs_gloo.md`.", ""]
    return "\n".join(lines)


def wan_lines(results: Path) -> list[str]:
    """The emulated WAN's check (``wan_link.md``, ``make wan-link``), one large transfer over
    one flow and over a striped link (``wan_stripes.md``, ``make wan-stripes``), the training
    across it (``wan.md``, ``make wan``) and the sweep that chose its learning rate
    (``wan_lr.md``, ``make wan-lr``), as those benchmarks wrote them."""
    lines = []
    for name, command in (("wan_link", "make wan-link"), ("wan_stripes", "make wan-stripes"),
                          ("wan", "make wan"), ("wan_lr", "make wan-lr")):
        path = results / f"{name}.md"
        lines += [path.read_text().strip() if path.exists() else
                  f"`{name}.md` is missing: run `{command}`.", "",
                  f"![{name}]({name}.png)" if (results / f"{name}.png").exists() else "", ""]
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    """Write REPORT.md and README_TABLE.md from the JSON results; print the README table."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--results", type=Path, default=RESULTS,
                    help="directory with p2p_vs_gloo.json / netns_dsgd.json (output goes there)")
    ap.add_argument("--rerender", action="store_true",
                    help="also rewrite p2p_vs_gloo.md and redraw its PNGs from the JSON")
    args = ap.parse_args(argv)
    results: Path = args.results
    p2p = load(results / "p2p_vs_gloo.json")
    netns = load(results / "netns_dsgd.json")
    if p2p is not None and args.rerender and "sizes" in p2p:
        plot_sizes(p2p, results / P2P_PNGS[0])
        plot_resnet(p2p, results / P2P_PNGS[1])
        (results / "p2p_vs_gloo.md").write_text(render_p2p(p2p, results))
    results.mkdir(parents=True, exist_ok=True)
    (results / "REPORT.md").write_text(render_report(p2p, netns, results))
    short = readme_table(p2p if p2p and "sizes" in p2p else None, netns, results)
    (results / "README_TABLE.md").write_text(short)
    sys.stdout.write(short)
    print(f"\nwrote {results / 'REPORT.md'} and {results / 'README_TABLE.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
