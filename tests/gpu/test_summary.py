"""GPU check for OUTOFCUDA_SUMMARY: a short CUDA matmul loop prints the exit
block with a utilisation the real NVML measured, and the JSON form carries
torch's peaks; a loop starved by a slow dataset is named, with the GPU idle
meanwhile. Skips cleanly where there is no NVIDIA GPU."""
import json
import re

from gpu import size

LOOP = """
import time, torch, _outofcuda
assert not torch.cuda.is_initialized()
a = torch.randn(N, N, device="cuda")
deadline = time.monotonic() + WAIT
# Keep the GPU busy until the sampler (every 200 ms) has 10 samples.
while time.monotonic() < deadline:
    for _ in range(20):
        b = a @ a
    torch.cuda.synchronize()
    devs = _outofcuda._summary_stats()["devices"]
    if devs and devs[0]["util_samples"] >= 10:
        break
else:
    raise SystemExit(f"the sampler took no 10 samples in {WAIT} s: {_outofcuda._summary_stats()}")
""".replace(
    "N", str(size(4096, 64))).replace("WAIT", str(size(60, 1)))


def test_matmul_loop_prints_the_block_with_utilisation(gpu, workdir):
    r = gpu.check(LOOP, cwd=workdir, env={"OUTOFCUDA_SUMMARY": "1"})
    header = [line for line in r.stderr.splitlines() if "outofcuda summary: cuda:0" in line]
    assert len(header) == 1, r.stderr
    m = re.search(r"utilisation    mean ([\d.]+) %; under 50 % in ([\d.]+) % of (\d+) samples",
                  r.stderr)
    assert m, r.stderr
    assert float(m.group(1)) > 0 and int(m.group(3)) >= 10, r.stderr
    assert re.search(r"this process   peak allocated [\d.]+ GiB, peak reserved [\d.]+ GiB",
                     r.stderr), r.stderr


def test_json_form_holds_utilisation_and_torch_peaks(gpu, workdir):
    gpu.check(LOOP, cwd=workdir, env={"OUTOFCUDA_SUMMARY": str(workdir / "summary.json")})
    doc = json.loads((workdir / "summary.json").read_text())
    (d,) = doc["devices"]
    assert d["device"] == 0 and d["samples"] >= 10 and d["utilization_mean"] > 0
    # Three 64 MiB float32 matrices at most live at once.
    assert d["peak_allocated"] >= 64 << 20 and d["peak_reserved"] >= d["peak_allocated"]
    assert 0 < d["memory_used_peak"] <= d["memory_total"]


STARVED = """
import time, torch, _outofcuda

class Stream(torch.utils.data.IterableDataset):
    # 10 ms an item, 40 ms a batch: far longer than the step on the GPU.
    def __iter__(self):
        while True:
            time.sleep(0.01)
            yield torch.ones(8)

a = torch.randn(N, N, device="cuda")
deadline = time.monotonic() + WAIT
for batch in torch.utils.data.DataLoader(Stream(), batch_size=4):
    b = a @ a
    torch.cuda.synchronize()
    devs = _outofcuda._summary_stats()["devices"]
    if (devs and devs[0]["paired"] >= 20) or time.monotonic() > deadline:
        break
""".replace("N", str(size(4096, 64))).replace("WAIT", str(size(60, 1)))


def test_a_loop_waiting_on_its_data_is_named_with_the_gpu_idle_meanwhile(gpu, workdir):
    gpu.check(STARVED, cwd=workdir, env={"OUTOFCUDA_SUMMARY": str(workdir / "summary.json")})
    doc = json.loads((workdir / "summary.json").read_text())
    wait = doc["input_wait"]
    assert wait["starved"] is True and wait["num_workers"] == 0, wait
    assert doc["no_gpu"] is None and len(doc["devices"]) == 1, doc
    # The real NVML: the GPU sat under 50 % busy while the main thread waited.
    paired = wait["gpu_under_50_while_waiting_share"][0]
    assert paired is not None and paired > 0.5, wait
    hint = doc["devices"][0]["hints"][0]
    assert hint.startswith("input pipeline: the GPU was under 50 % busy in "), hint
