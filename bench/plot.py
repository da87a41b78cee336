"""One PNG per experiment (matplotlib, no display)."""

from __future__ import annotations


def plot(res: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    rows = res["rows"]
    if res["experiment"] == "streams":
        x, title = "streams", "records/s produced vs number of streams (latency config)"
        series = sorted({r["system"] for r in rows})
        for s in series:
            pts = sorted((r[x], r["produce_rps"]) for r in rows if r["system"] == s)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=s)
        ax.set_xscale("log", base=2)
    elif res["experiment"] == "vlogs":
        x, title = "vlogs", "records/s produced vs shared vlogs per broker (R=3)"
        for s in sorted({r["streams"] for r in rows}):
            pts = sorted((r[x], r["produce_rps"]) for r in rows if r["streams"] == s)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"{s} streams")
        ax.set_xscale("log", base=2)
    else:
        x, title = "chunk", "records/s produced, 1 stream x 32 streamlets x 4 groups, R=3"
        for key in sorted({(r["system"], r["producers"]) for r in rows}):
            pts = sorted((r[x], r["produce_rps"]) for r in rows if (r["system"], r["producers"]) == key)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"{key[0]}, {key[1]} producers")
        ax.set_xscale("log", base=2)
    ax.set_xlabel(x)
    ax.set_ylabel("records/s")
    ax.set_title(title, fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    m = res.get("machine", {})
    fig.text(0.01, 0.01, f"{m.get('cpus')} cores, {m.get('when')}; peer: Tansu, memory storage, "
             "no replication", fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
