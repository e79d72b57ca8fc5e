"""--disk-total under load: N stateless /v1/completions requests of 8K-32K tokens (random token
ids, 8 tokens generated, greedy, two clients at once) against `localheap serve` on the demo model
with default flags (recall on, sessions kept) and `--disk-total BUDGET`. `du -sb` samples the
sessions directory every second; the summary gives the peak against the budget, the HTTP statuses
and the server's reclaim counters.

    python docs/disk_total_runs/load.py 100 200M        # N requests, the budget
"""

import random
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter

import httpx

from localheap.governor.budget import parse_size

n, budget = int(sys.argv[1]), sys.argv[2]
port = 8871
sessions = tempfile.mkdtemp(prefix="localheap-load-")
proc = subprocess.Popen(["localheap", "serve", "--port", str(port), "--sessions-dir", sessions,
                         "--disk-total", budget], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
samples, statuses, lock = [], Counter(), threading.Lock()
stop = threading.Event()


def du() -> int:
    out = subprocess.run(["du", "-sb", sessions], capture_output=True, text=True).stdout
    return int(out.split()[0]) if out else 0


def sample() -> None:
    while not stop.wait(1.0):
        samples.append(du())


def client(jobs: list[int], seed: int) -> None:
    rng = random.Random(seed)
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=900) as http:
        for size in jobs:
            prompt = [rng.randrange(3, 1024) for _ in range(size)]
            try:
                r = http.post("/v1/completions", json={"model": "demo", "prompt": prompt, "max_tokens": 8,
                                                       "temperature": 0})
                status = r.status_code
            except httpx.HTTPError as e:
                status = type(e).__name__
            with lock:
                statuses[status] += 1
                done = sum(statuses.values())
            print(f"{done:3d}/{n} {size:6d} tokens -> {status}  dir {samples[-1] if samples else 0:,} B", flush=True)


try:
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10) as http:
        for _ in range(240):
            try:
                if http.get("/health").status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
    t0 = time.time()
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    pick = random.Random(0)
    sizes = [pick.randint(8 * 1024, 32 * 1024) for _ in range(n)]
    clients = [threading.Thread(target=client, args=(sizes[i::2], i)) for i in range(2)]
    for c in clients:
        c.start()
    for c in clients:
        c.join()
    stop.set()
    sampler.join()
    samples.append(du())
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as http:
        metrics = {line.split()[0]: line.split()[1] for line in http.get("/metrics").text.splitlines()
                   if line.startswith("localheap_disk") or line.startswith("localheap_requests_")}
        health = http.get("/health").json()
    limit = parse_size(budget)
    five = sum(v for k, v in statuses.items() if not isinstance(k, int) or k >= 500)
    print(f"\n{n} requests of 8K-32K tokens ({sum(sizes):,} in all) in {time.time() - t0:.0f} s; statuses "
          f"{dict(statuses)}; 5xx or no answer: {five}")
    print(f"sessions dir (du -sb, every 1 s, {len(samples)} samples): peak {max(samples):,} B, budget "
          f"{limit:,} B ({budget}); {'never above' if max(samples) <= limit else 'ABOVE'} the budget")
    print("server:", metrics)
    print("health:", health)
finally:
    proc.terminate()
    _, err = proc.communicate(timeout=60)
    warnings = [line for line in err.splitlines() if "disk-total" in line or "ERROR" in line]
    print(f"server log: {len(warnings)} --disk-total/ERROR lines; last: {warnings[-3:]}")
    subprocess.run(["rm", "-rf", sessions])
