"""``planner.host_cpu``: the front end's CPU on this machine is the machine's busy time less the engine
processes' (found by their module, ``*.engine_host``) and the measuring process's own."""

from __future__ import annotations

import subprocess
import sys

from planner import host_cpu

# Burns about 0.3 s of CPU, says so, then waits for its stdin to close.
BURN = "import sys, time\nt = time.process_time()\nwhile time.process_time() - t < 0.3: pass\nprint('done', flush=True)\nsys.stdin.read()\n"


def _burner(*argv: str) -> subprocess.Popen:
    p = subprocess.Popen(
        [sys.executable, "-c", BURN, *argv], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert p.stdout.readline() == "done\n"  # its CPU is spent
    return p


def test_engine_processes_are_told_apart_and_their_cpu_read():
    engine, other = _burner("prefill_worker.engine_host"), _burner("router")
    try:
        pids = host_cpu._engine_pids()
        assert str(engine.pid) in pids and str(other.pid) not in pids
        assert host_cpu._process_cpu_s(engine.pid) >= 0.25
        assert host_cpu._process_cpu_s(999_999_999) == 0.0  # gone: nothing
    finally:
        for p in (engine, other):
            p.stdin.close()
            p.wait(timeout=30)


def test_the_front_end_is_the_machine_less_the_engines_and_this_process(monkeypatch):
    monkeypatch.setattr(host_cpu, "_machine_busy_s", lambda: 10.0)
    monkeypatch.setattr(host_cpu, "_engine_pids", lambda: ["1", "2"])
    spent = {"1": 3.0, "2": 2.5, "self": 1.0}
    monkeypatch.setattr(host_cpu, "_process_cpu_s", lambda pid: spent[str(pid)])
    assert host_cpu.usage() == {"machine": 10.0, "engines": {"1": 3.0, "2": 2.5}, "self": 1.0}
    assert host_cpu.available()  # this Linux machine has /proc


def test_a_run_is_split_into_the_cores_each_part_kept_busy():
    before = {"machine": 10.0, "engines": {"7": 1.0, "8": 2.0, "9": 0.5}, "self": 1.0}
    after = {"machine": 14.0, "engines": {"7": 2.5, "8": 2.5, "10": 1.0}, "self": 1.5}
    # Engine 9 ended meanwhile (its last seconds count as the front end's); 10 started.
    assert host_cpu.between(before, after) == {
        "machine": 4.0,
        "engines": {"7": 1.5, "8": 0.5, "10": 1.0},
        "front": 0.5,
    }
    assert host_cpu.cores_between(before, after, 2.0) == {
        "machine": 2.0,
        "engines": [0.75, 0.5, 0.25],
        "front": 0.25,
    }
    # An engine process missed by the first reading counts whole: never a negative front end.
    assert host_cpu.between({**before, "engines": {}}, after)["front"] == 0.0
    now = host_cpu.usage()
    assert set(now) == {"machine", "engines", "self"} and now["machine"] > 0


def test_the_machines_busy_time_leaves_out_idle_iowait_and_steal():
    """Steal is time the hypervisor gave another guest: no process here spent it (it was counted as
    the front end's CPU on a shared VM)."""
    tick = host_cpu._TICK
    #          user nice system idle iowait irq softirq steal guest guest_nice
    stat = (
        f"cpu  {50 * tick} {10 * tick} {30 * tick} 900 80 {5 * tick} {5 * tick} {40 * tick} 0 0\ncpu0 1 2 3\n"
    )
    assert host_cpu._machine_busy_s(stat) == 100.0
    assert host_cpu._machine_busy_s() > 0  # this machine's own
