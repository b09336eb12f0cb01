"""What one /metrics scrape costs real vLLM's API process: the whole page against the filtered one tuner asks for.

vLLM serves `/metrics` from prometheus-fastapi-instrumentator's handler, which renders its whole registry, and mounts
prometheus_client's app, which honours `name[]`, below it (`/metrics/?name[]=...`); tuner's scrape asks for the
families its summary reads there (tuner.load.server_metrics.WANTED_SAMPLES). The cost is read as the API process's
own CPU time (utime + stime of /proc/PID/stat) over blocks of scrapes, so a busy machine slows the scrapes but does
not move the figure much. Blocks alternate whole / filtered; reported: CPU ms a scrape (median of the blocks), bytes
a page, and the ratio.

    .venv/bin/python benchmarks/metrics_scrape_cost.py                     # paths from scripts/real-vllm
    .venv/bin/python benchmarks/metrics_scrape_cost.py --blocks 8 --per-block 100
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import urllib.request
from pathlib import Path

from vllm_agreement import _paths, _port_free, _start, _stop

from tuner.load.server_metrics import WANTED_SAMPLES


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vllm-python", help="the vLLM venv's python (default: from scripts/real-vllm)")
    parser.add_argument("--model-dir", help="the model directory (default: the tiny model of scripts/real-vllm)")
    parser.add_argument("--port", type=int, default=8123)
    parser.add_argument("--blocks", type=int, default=6, help="blocks of each kind, alternating")
    parser.add_argument("--per-block", type=int, default=60, help="scrapes a block")
    args = parser.parse_args()
    if not _port_free(args.port):
        raise SystemExit(f"port {args.port} is taken; pass --port")
    python, model = _paths(args)
    base = f"http://127.0.0.1:{args.port}"
    query = "&".join(f"name[]={urllib.request.quote(n)}" for n in WANTED_SAMPLES)
    urls = {"whole": f"{base}/metrics", "filtered": f"{base}/metrics/?{query}"}
    with tempfile.TemporaryDirectory() as tmp:
        proc = _start(python, model, args.port, Path(tmp) / "vllm.log")
        try:
            sizes = {kind: len(urllib.request.urlopen(url, timeout=10).read()) for kind, url in urls.items()}
            cost: dict[str, list[float]] = {kind: [] for kind in urls}
            for block in range(2 * args.blocks):
                kind = ("whole", "filtered")[(block + block // 2) % 2]  # whole, filtered, filtered, whole, ...
                before = _cpu_s(proc.pid)
                for _ in range(args.per_block):
                    urllib.request.urlopen(urls[kind], timeout=10).read()
                cost[kind].append((_cpu_s(proc.pid) - before) / args.per_block * 1000)
        finally:
            _stop(proc)
    load = os.getloadavg()[0]
    print(f"vLLM API process CPU per /metrics scrape ({args.blocks} blocks of {args.per_block}, load {load:.2f})")
    print("| page | bytes | CPU ms a scrape (median) | blocks |")
    print("|---|---:|---:|---|")
    for kind in urls:
        blocks = ", ".join(f"{c:.1f}" for c in cost[kind])
        print(f"| {kind} | {sizes[kind]:,} | {statistics.median(cost[kind]):.2f} | {blocks} |")
    print(f"ratio filtered / whole: {statistics.median(cost['filtered']) / statistics.median(cost['whole']):.3f}")


if __name__ == "__main__":
    main()
