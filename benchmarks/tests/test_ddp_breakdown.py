"""The DDP benchmark's breakdown of a step: its phases and whose CPU it took."""

from __future__ import annotations

from pathlib import Path

from benchmarks.ddp_vs_gloo import cpu_ticks, process_kind, step_phases, thread_ticks


def test_a_steps_phases_are_the_gaps_between_its_times() -> None:
    assert step_phases([10.0, 10.5, 11.25, 13.0, 17.0]) == [0.5, 0.75, 1.75, 4.0]


def test_processes_are_told_apart_by_their_command_lines() -> None:
    assert process_kind([b"/venv/bin/decentd", b"--config", b"/tmp/d.yaml"]) == "daemons"
    assert process_kind([b"/venv/bin/python", b"-m", b"decentd", b"--rank", b"0"]) == "daemons"
    assert process_kind([b"/venv/bin/python", b"/repo/benchmarks/ddp_vs_gloo.py",
                         b"--rank-of-netns", b"--steps", b"10"]) == "ranks"
    assert process_kind([b"/venv/bin/python", b"benchmarks/ddp_vs_gloo.py", b"--netns",
                         b"8"]) is None  # the driver waits for the ranks
    assert process_kind([b"/venv/bin/python", b"/venv/bin/decentrun", b"-np", b"2", b"--",
                         b"python", b"benchmarks/ddp_vs_gloo.py"]) is None
    assert process_kind([b"/usr/bin/sleep", b"1"]) is None


def test_a_threads_ticks_are_read_past_a_name_with_spaces_and_parentheses() -> None:
    stat = "42 (pt (gloo) 1) S 1 2 3 4 5 6 7 8 9 10 1234 567 0 0 20 0 1 0 99"
    assert thread_ticks(stat) == ("pt (gloo) 1", 1234, 567)


def _process(proc: Path, pid: int, argv: list[str], threads: dict[int, tuple[str, int, int]],
             ) -> None:
    (proc / str(pid) / "task").mkdir(parents=True)
    (proc / str(pid) / "cmdline").write_bytes(b"\0".join(a.encode() for a in argv) + b"\0")
    for tid, (name, user, system) in threads.items():
        (proc / str(pid) / "task" / str(tid)).mkdir()
        fields = ["S", *["0"] * 10, str(user), str(system), "0", "0"]
        (proc / str(pid) / "task" / str(tid) / "stat").write_text(
            f"{tid} ({name}) {' '.join(fields)}\n")


def test_cpu_is_summed_by_kind_over_processes_and_their_threads(tmp_path: Path) -> None:
    rank = ["python", "benchmarks/ddp_vs_gloo.py", "--rank-of-netns"]
    _process(tmp_path, 10, rank, {10: ("python", 100, 20), 11: ("pt_gloo_runloop", 7, 30),
                                  12: ("gloo_tcp_loop", 1, 50)})
    _process(tmp_path, 20, rank, {20: ("python", 5, 1)})
    _process(tmp_path, 30, ["/venv/bin/decentd", "--config", "x"],
             {30: ("decentd", 300, 40), 31: ("decentd-send-1", 2, 60)})
    _process(tmp_path, 40, ["bash"], {40: ("bash", 999, 999)})
    (tmp_path / "self").mkdir()  # not a process directory
    assert cpu_ticks(tmp_path) == {"ranks": (105, 21), "gloo threads": (8, 80),
                                   "daemons": (302, 100)}


def test_the_report_row_says_where_decents_step_differs() -> None:
    from benchmarks.report import ddp_breakdown_text

    phases = {"before forward": 1.0, "forward": 2.0, "after backward": 3.0}
    res = {"phases_ms": {"decent": {**phases, "backward": 263.4},
                         "gloo": {**phases, "backward": 181.6}},
           "cpu_ms_per_step": {"decent": {"daemons": [374.0, 398.0]},
                               "gloo": {"gloo threads": [62.0, 372.0]}}}
    assert ddp_breakdown_text(res) == (
        "; backward 263 vs 182 ms; CPU per step moving the gradients (user + system, all "
        "ranks): decent's daemons 374 + 398 ms, gloo's threads 62 + 372 ms")
    assert ddp_breakdown_text({"step_median_s": {}}) == ""  # a run from before
    assert ddp_breakdown_text({**res, "cpu_ms_per_step": {"gloo": {}}}) == ""  # not profiled


def test_the_buffer_broadcast_sends_one_flat_tensor_per_dtype_from_rank_0() -> None:
    """As DDP's ``broadcast_buffers``: BatchNorm's running statistics in one float32 tensor,
    its batch counters in one int64 tensor."""
    import torch
    from torch import nn

    from benchmarks.ddp_vs_gloo import small_ops

    sent: list[tuple[int, torch.dtype, int, str]] = []

    class Recorder:
        def broadcast(self, t: torch.Tensor, src: int, group: str) -> None:
            sent.append((t.numel(), t.dtype, src, group))

        def all_reduce(self, t: torch.Tensor, group: str) -> None:
            sent.append((t.numel(), t.dtype, -1, group))

    ops = small_ops(torch, Recorder(), nn.Sequential(nn.BatchNorm2d(3), nn.Linear(2, 2),
                                                     nn.BatchNorm1d(5)))
    ops["broadcast_buffers"]("g")
    ops["allreduce_4kib"]("g")
    assert sent == [(16, torch.float32, 0, "g"), (2, torch.int64, 0, "g"),
                    (1024, torch.float32, -1, "g")]


def test_the_buffer_broadcast_row_is_reported_from_the_namespaces_run() -> None:
    from benchmarks.report import ddp_rows

    rows: list[tuple[object, ...]] = []
    netns = {"broadcast_buffers_median_us": {"decent": 9700.0, "gloo": 1900.0},
             "broadcast_buffers_decent_over_gloo": 9700.0 / 1900.0}
    ddp_rows(lambda *row: rows.append(row), None, netns)
    (row,) = [r for r in rows if r[0] == "10b"]
    assert row[2] == 9700.0 / 1900.0 and "(9700 vs 1900 us)" in str(row[5])
