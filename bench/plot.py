"""One PNG per experiment (matplotlib, no display)."""

from __future__ import annotations


def plot(res: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    rows = res.get("rows", [])
    if res["experiment"] == "streams":
        x, title = "streams", "records/s vs streams, median and range of runs (100 B, linger 5 ms, 16 KB)"
        for phase in ("sequential",):
            for system in ("peer", "kera R=1", "kera R=3"):
                for what, style in (("produce_rps", "-"), ("consume_rps", ":")):
                    cells = sorted((c for c in res["cells"] if c["system"] == system and c["phase"] == phase
                                    and c[what]), key=lambda c: c["streams"])
                    if not cells:
                        continue
                    xs = [c["streams"] for c in cells]
                    med = [c[what]["median"] for c in cells]
                    err = [[m - c[what]["min"] for m, c in zip(med, cells, strict=True)],
                           [c[what]["max"] - m for m, c in zip(med, cells, strict=True)]]
                    ax.errorbar(xs, med, yerr=err, marker="o", linestyle=style, capsize=3,
                                label=f"{system} {what.split('_')[0]}")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
    elif res["experiment"] == "vlogs":
        x, title = "vlogs", "records/s produced vs shared vlogs per broker (chunk 1 KB)"
        for key in sorted({(r["system"], r["streams"]) for r in rows if r["chunk"] == 1024}):
            pts = sorted((r[x], r["produce_rps"]) for r in rows
                         if (r["system"], r["streams"]) == key and r["chunk"] == 1024)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"{key[0]}, {key[1]} streams")
        ax.set_xscale("log", base=2)
    elif res["experiment"] == "metadata":
        x, title = "streams", "streams (topics) created per second, by step, 1 streamlet, kera R=3"
        for r in rows:
            pts = [(c["streams"], c["step_per_s"]) for c in r["create"]]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=r["system"])
        ax.set_xscale("log")
        ax.set_yscale("log")
    elif res["experiment"] == "many":
        x, title = "streams", "one record per stream: records/s (solid) and KiB per stream (dashed), R=3"
        kera = sorted((r for r in rows if r["system"] == "kera R=3"), key=lambda r: r["streams"])
        xs = [r["streams"] for r in kera]
        ax.plot(xs, [r["produce_per_s"] for r in kera], marker="o", label="kera produce/s")
        ax.plot(xs, [r["consume_per_s"] for r in kera], marker="o", label="kera consume/s")
        for r in rows:
            if r["system"] != "kera R=3":
                ax.plot([r["streams"]], [r["produce_per_s"]], marker="s", linestyle="", label="peer produce/s")
                ax.plot([r["streams"]], [r["consume_per_s"]], marker="D", linestyle="", label="peer consume/s")
        mem = ax.twinx()
        mem.plot(xs, [r["broker_kib_per_stream"] for r in kera], "k--", marker="x", label="brokers KiB/stream")
        mem.plot(xs, [r["coordinator_kib_per_stream"] for r in kera], "g--", marker="x",
                 label="coordinator KiB/stream")
        mem.set_ylabel("KiB per stream")
        mem.set_ylim(bottom=0)
        mem.legend(fontsize=8, loc="center right")
        ax.set_xscale("log")
        ax.set_yscale("log")
    elif res["experiment"] == "latency":
        x, title = "offered", "produce-ack latency vs offered load, 128 streams (p50 solid, p99 dashed)"
        for system in ("peer", "kera R=1", "kera R=3"):
            pts = sorted((r["offered"], r["produce_p50_ms"], r["produce_p99_ms"]) for r in rows
                         if r["system"] == system and r.get("produce_p50_ms") is not None)
            if pts:
                line, = ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"{system} p50")
                ax.plot([p[0] for p in pts], [p[2] for p in pts], marker="x", linestyle="--",
                        color=line.get_color(), label=f"{system} p99")
        ax.set_xscale("log")
        ax.set_yscale("log")
    elif res["experiment"] == "throughput":
        x, title = "producer API (2 producer processes, 1 consumer at once)", \
            "records/s with R=3, 1 stream x 32 streamlets, median and range of runs"
        summary = res["summary"]
        for i, (what, label) in enumerate((("produce_rps", "acknowledged"), ("consume_rps", "consumed"))):
            xs = [j + (i - 0.5) * 0.35 for j in range(len(summary))]
            med = [s_[what]["median"] for s_ in summary]
            err = [[m - s_[what]["min"] for m, s_ in zip(med, summary, strict=True)],
                   [s_[what]["max"] - m for m, s_ in zip(med, summary, strict=True)]]
            ax.bar(xs, med, width=0.35, yerr=err, capsize=4, label=label)
        ax.axhline(1_000_000, color="grey", linestyle="--", linewidth=1, label="1 M records/s")
        ax.set_xticks(range(len(summary)), [f"{s_['api']}, chunk {s_['chunk'] // 1024} KB" for s_ in summary])
    ax.set_xlabel(x)
    ax.set_ylabel({"latency": "ms", "metadata": "created/s"}.get(res["experiment"], "records/s"))
    ax.set_title(title, fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    m = res.get("machine", {})
    load = res.get("load")
    busy = f", load average {load['start'][0]:.1f} to {load['end'][0]:.1f}" if load else ""
    if res["experiment"] == "throughput":
        busy = ", load average " + ", ".join(f"{s_['api']} {s_['load'][0]}-{s_['load'][1]}" for s_ in res["summary"])
    peer = "; peer: Tansu, memory storage, no replication" if res["experiment"] != "throughput" else ""
    fig.text(0.01, 0.01, f"{m.get('cpus')} cores{busy}, {m.get('when')}{peer}", fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
