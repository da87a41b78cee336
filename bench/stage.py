"""Running benchmark workers: spawned processes that start together at a barrier."""

from __future__ import annotations

import queue as queue_mod
import threading
import time
import traceback

TIME_CHECK = 512            # records sent between two clock readings of a timed run
WARM_SECONDS_RATE = 10_000  # warm-up records per second of a timed run (not timed, not counted)
QUIET_BUSY, QUIET_MAX_S = 0.15, 3.0  # the clock starts once the machine is this idle (or after this long)


def _proc_main(results, kind: str, idx: int, fn, args: tuple, kwargs: dict) -> None:
    try:
        out = fn(*args, **kwargs)
        results.put((kind, idx, out, None))
    except BaseException:
        if kwargs.get("barrier") is not None:
            kwargs["barrier"].abort()  # don't leave the other workers waiting
        results.put((kind, idx, None, traceback.format_exc()))


def split(n: int, k: int) -> list[int]:
    return [n // k + (1 if i < n % k else 0) for i in range(k)]


def percentile(sorted_vals: list[float], q: float) -> float | None:
    if not sorted_vals:
        return None
    i = min(len(sorted_vals) - 1, max(0, round(q / 100.0 * (len(sorted_vals) - 1))))
    return sorted_vals[i]


def _cpu_ticks() -> list[int]:
    """The machine's CPU time so far, all CPUs, by kind (/proc/stat: user, nice, system,
    idle, iowait, irq, softirq, steal, ...)."""
    with open("/proc/stat") as f:
        return [int(x) for x in f.readline().split()[1:]]


def _busy(window: float = 0.1) -> float:
    """The machine's busy fraction (all CPUs) over ``window`` seconds."""
    a = _cpu_ticks()
    time.sleep(window)
    b = _cpu_ticks()
    return 1 - (b[3] + b[4] - a[3] - a[4]) / max(1, sum(b) - sum(a))


def _probe_ms() -> float:
    """A fixed piece of pure-Python work, best of three, in milliseconds: how fast the
    machine runs this process now (a slower run beside a slow probe is the machine's)."""
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        x = 0
        for i in range(200_000):
            x += i & 7
        best = min(best, time.perf_counter() - t)
    return round(best * 1000, 2)


def quiet(max_s: float = QUIET_MAX_S, busy: float = QUIET_BUSY) -> dict:
    """Wait until the machine is nearly idle (the last run's leftovers: a deleted stream's
    files, a stopped broker, flushes), at most ``max_s``: every timed phase starts from the
    same state. Returns how long it waited and how busy the machine was then."""
    t0 = time.monotonic()
    b = _busy()
    while b > busy and time.monotonic() - t0 < max_s:
        b = _busy()
    return {"waited_s": round(time.monotonic() - t0, 2), "busy": round(b, 3), "probe_ms": _probe_ms()}


def _start_when_quiet(barrier, workers: int, timeout_s: float, out: dict) -> None:
    """Once every worker waits at the barrier (set up, warmed up), wait for a quiet machine,
    then release them all: the clock starts."""
    deadline = time.monotonic() + timeout_s
    while barrier.n_waiting < workers and not barrier.broken and time.monotonic() < deadline:
        time.sleep(0.01)
    if barrier.broken:
        return   # a worker failed: it is reported by run_stage
    out.update(quiet())
    out["_ticks"] = _cpu_ticks()
    try:
        barrier.wait(timeout=max(1.0, deadline - time.monotonic()))
    except threading.BrokenBarrierError:
        pass   # a worker failed: it is reported by run_stage


def run_stage(ctx, jobs: list, timeout_s: float, settled: dict | None = None) -> dict:
    """Run [(kind, idx, fn, args, kwargs)] in spawned processes that meet at one
    barrier, released once the machine is quiet (``quiet``; what it waited is put in
    ``settled``, with ``steal``: the share of the machine's CPU time the hypervisor gave
    others while the stage ran); return {(kind, idx): result}.  Raises if any worker fails."""
    results = ctx.Queue()
    barrier = ctx.Barrier(len(jobs) + 1)
    starter = threading.Thread(target=_start_when_quiet, args=(barrier, len(jobs), timeout_s,
                                                             settled if settled is not None else {}),
                               daemon=True)
    procs = [
        ctx.Process(
            target=_proc_main,
            args=(results, kind, idx, fn, args, {**kw, "barrier": barrier}),
            daemon=True,
        )
        for kind, idx, fn, args, kw in jobs
    ]
    for pr in procs:
        pr.start()
    starter.start()
    outs: dict = {}
    errors = []
    reported: set = set()
    deadline = time.monotonic() + timeout_s
    dead_since: float | None = None
    try:
        while len(reported) < len(procs):
            try:
                kind, idx, out, err = results.get(timeout=0.2)
            except queue_mod.Empty:
                now = time.monotonic()
                if now > deadline:
                    errors.append(f"timed out waiting for workers after {timeout_s}s")
                    break
                # A worker that exited without reporting (e.g. crashed while
                # starting) would otherwise keep the rest at the barrier.
                silent = [
                    (kind, idx)
                    for pr, (kind, idx, *_rest) in zip(procs, jobs, strict=True)
                    if pr.exitcode is not None and (kind, idx) not in reported
                ]
                if silent:
                    dead_since = dead_since or now
                    if now - dead_since > 2.0:
                        barrier.abort()
                        codes = [pr.exitcode for pr in procs]
                        errors.append(f"{silent} exited without a result; exit codes {codes}")
                        break
                continue
            reported.add((kind, idx))
            if err:
                errors.append(f"{kind}{idx}: {err}")
            else:
                outs[(kind, idx)] = out
    finally:
        if starter.is_alive():
            barrier.abort()
        starter.join()
        for pr in procs:
            pr.join(timeout=5)
            if pr.is_alive():
                pr.kill()
                pr.join()
    if errors:
        raise RuntimeError("bench worker failed:\n" + "\n".join(errors))
    if settled is not None and "_ticks" in settled:
        a, b = settled.pop("_ticks"), _cpu_ticks()
        settled["steal"] = round((b[7] - a[7]) / max(1, sum(b) - sum(a)), 4)
    return outs


def summarize(pouts: list[dict], couts: list[dict], consume_start: float | None = None) -> dict:
    """Rates and latencies of one run from its workers' reports (t_start/t_end are
    time.monotonic(), comparable across processes): records over the time from the
    first worker's start to the last producer's (consumer's) end."""
    start = min(o["t_start"] for o in pouts + couts)
    p_end = max(o["t_end"] for o in pouts)
    produced = sum(o["records"] for o in pouts)
    lat = sorted(x for o in pouts for x in o["latencies_ms"])
    out = {"produced": produced, "produce_s": round(p_end - start, 3),
           "produce_rps": round(produced / (p_end - start)),
           "produce_p50_ms": rounded(percentile(lat, 50)), "produce_p99_ms": rounded(percentile(lat, 99)),
           "produce_p999_ms": rounded(percentile(lat, 99.9)),
           "latency_samples": len(lat), "wall_s": round(p_end - start, 3)}
    if couts:
        c_start = start if consume_start is None else consume_start
        c_end = max(o["t_end"] for o in couts)
        consumed = sum(o["records"] for o in couts)
        out.update(consumed=consumed, consume_s=round(c_end - c_start, 3),
                   consume_rps=round(consumed / (c_end - c_start)),
                   wall_s=round(max(p_end, c_end) - start, 3))
    return out


def rounded(x: float | None) -> float | None:
    return None if x is None else round(x, 3)
