"""`specdec run --engine ray` on a local Ray (2 CPUs, started once for the module) and the tiny saved pair:
the same records as --engine local, a worker killed mid-request costs a retry and never a record, a killed
driver resumes exactly once, and the mistakes a user can make say so in one line."""

import collections
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest
import ray
from typer.testing import CliRunner

from specdec_cli.batch import BatchSummary, Completion, RayWorkers, WorkerReport, read_requests, run_streamed
from specdec_cli.batch.ray_workers import _same_everywhere
from specdec_cli.cli import app
from specdec_cli.errors import InputError

from tests.cli_result import assert_exited
from tests.run.test_run_command import jsonl, read, without_timings

ROOT = Path(__file__).resolve().parents[2]
WIDE = {"COLUMNS": "200"}
RECORDS = 40

LINES = [
    {"id": "z", "prompt": "def add(a, b):", "max_new_tokens": 6},
    {"id": "a", "messages": [{"role": "user", "content": "Hello, how are you?"}]},
    "{oops",
    {"custom_id": "m", "method": "POST", "url": "/v1/chat/completions",
     "body": {"messages": [{"role": "user", "content": "The quick brown fox"}], "max_tokens": 5}},
    {"id": "s1", "prompt": "Speculative decoding", "temperature": 1.0, "seed": 11},
    {"id": "s2", "prompt": "Speculative decoding", "temperature": 1.0, "seed": 12},
    {"id": "s3", "prompt": "for i in range(10):", "temperature": 0.8, "top_k": 20, "seed": 13},
    {"prompt": "The quick brown fox"},
]


@pytest.fixture(scope="module")
def ray_cluster():
    """One local Ray for the module; stopped at the end with every process it started."""
    context = ray.init(num_cpus=2, include_dashboard=False, logging_level="WARNING")
    yield context.address_info["address"]
    ray.shutdown()
    deadline = time.monotonic() + 30
    while ray_processes() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert ray_processes() == []


def ray_processes() -> list[str]:
    """Ray's processes among this one's children (gcs, raylet, workers), by their command line."""
    found = []
    for child in psutil.Process().children(recursive=True):
        try:
            found.append(" ".join(child.cmdline())[:80])
        except psutil.Error:
            pass
    return [line for line in found if "ray" in line]


def pair_args(tiny_pair, tokens: int = 8) -> list[str]:
    return ["--target", tiny_pair.target, "--draft", tiny_pair.draft, "--dtype", "float32", "-n", str(tokens), "-t", "0"]


def run(*args):
    return CliRunner().invoke(app, ["run", *map(str, args)], env=WIDE)


def many_prompts(path: Path) -> Path:
    path.write_text(jsonl({"id": f"r{i}", "prompt": f"Hello {i}"} for i in range(RECORDS)))
    return path


def assert_each_id_once_in_order(output: Path) -> None:
    records = read(output)
    assert [record["id"] for record in records] == [f"r{i}" for i in range(RECORDS)]
    assert [record["error"] for record in records] == [None] * RECORDS


def test_two_workers_write_the_records_of_engine_local(ray_cluster, tiny_pair, tmp_path):
    source = tmp_path / "in.jsonl"
    source.write_text(jsonl(LINES))
    # Ray workers answer one request at a time: the local run that must match them does too (sampled texts
    # depend on the drafts, and a batch drafts otherwise).
    local = run(source, "-o", tmp_path / "local.jsonl", *pair_args(tiny_pair), "--batch-size", "1")
    assert_exited(local, 1)  # the malformed line's error record
    on_ray = run(source, "-o", tmp_path / "ray.jsonl", *pair_args(tiny_pair), "--engine", "ray", "--workers", "2")
    assert_exited(on_ray, 1)
    records = read(tmp_path / "ray.jsonl")
    assert without_timings(records) == without_timings(read(tmp_path / "local.jsonl"))
    assert records[2]["error"] == "line 3: not valid JSON (Expecting property name enclosed in double quotes at column 2)"
    assert records[4]["text"] != records[5]["text"]  # the seeds, not the worker, decide a sampled text
    assert f"ray: 2 workers, each loaded:\n  target: {tiny_pair.target} · cpu · float32\n" in on_ray.stderr
    assert "on 2 Ray workers" in on_ray.stderr
    worker_rows = [line for line in on_ray.stderr.splitlines() if line.startswith("│ worker ")]
    assert len(worker_rows) == 2 and sum(int(row.split("│")[2].split()[0]) for row in worker_rows) == len(LINES) - 1


def busy_workers() -> list[psutil.Process]:
    """The Ray worker processes in the middle of a request (Ray titles them after the running method)."""
    busy = []
    for child in psutil.Process().children(recursive=True):
        try:
            if child.cmdline()[:1] == ["ray::Worker.generate"]:
                busy.append(child)
        except psutil.Error:
            pass
    return busy


def kill_a_busy_worker_after(output: Path, records: int, killed: list) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if output.exists() and output.read_bytes().count(b"\n") >= records and (busy := busy_workers()):
            busy[0].send_signal(signal.SIGKILL)
            killed.append(output.read_bytes().count(b"\n"))
            return
        time.sleep(0.005)


def test_a_worker_killed_mid_request_costs_a_retry_never_a_record(ray_cluster, tiny_pair, tmp_path):
    source, output, killed = many_prompts(tmp_path / "in.jsonl"), tmp_path / "out.jsonl", []
    killer = threading.Thread(target=kill_a_busy_worker_after, args=(output, 3, killed))
    killer.start()
    result = run(source, "-o", output, *pair_args(tiny_pair, tokens=48), "--engine", "ray", "--workers", "2")
    killer.join()
    assert_exited(result, 0)
    assert killed and killed[0] < RECORDS  # the kill landed while the job ran
    assert_each_id_once_in_order(output)
    assert "died mid-request 1×" in result.stderr


def driver_mid_file(ray_cluster, source: Path, args: list[str]) -> subprocess.Popen:
    """`specdec run ARGS` in its own process, joined to the module's Ray, once it has written 3 records."""
    output = Path(args[args.index("-o") + 1])
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    driver = subprocess.Popen([sys.executable, "-m", "specdec_cli", "run", str(source), *args, "--address", ray_cluster],
                              cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while (not output.exists() or output.read_bytes().count(b"\n") < 3) and driver.poll() is None \
            and time.monotonic() < deadline:
        time.sleep(0.01)
    assert driver.poll() is None, driver.stderr.read().decode()[-2000:]  # still running: stopped mid-file
    return driver


@pytest.mark.parametrize("stop", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
def test_a_stopped_driver_resumes_with_each_record_exactly_once(ray_cluster, tiny_pair, tmp_path, stop):
    source, output = many_prompts(tmp_path / "in.jsonl"), tmp_path / "out.jsonl"
    args = ["-o", str(output), *pair_args(tiny_pair, tokens=32), "--engine", "ray", "--workers", "2"]
    driver = driver_mid_file(ray_cluster, source, args)
    driver.send_signal(stop)
    _, stderr = driver.communicate(timeout=60)
    if stop == signal.SIGTERM:  # as after Ctrl-C, though ray.init installs a SIGTERM handler of its own
        assert driver.returncode == 143, stderr.decode()[-2000:]
        assert stderr.decode().strip().splitlines()[-1].endswith("run the same command with --resume to finish")
    assert 3 <= output.read_bytes().count(b"\n") < RECORDS
    resumed = run(source, *args, "--resume")  # its workers went with the driver: Ray frees their CPUs
    assert_exited(resumed, 0)
    assert_each_id_once_in_order(output)


# ---- the scheduler alone, on a stand-in for Ray --------------------------------------------------


class StandInRay:
    """What RayWorkers calls of Ray: results are ready at once, in the order asked for."""

    exceptions = ray.exceptions

    def wait(self, references, num_returns, timeout):
        return references[:1], references[1:]

    def get(self, reference):
        if isinstance(reference.value, BaseException):
            raise reference.value
        return reference.value


class Reference:
    """An ObjectRef's stand-in: hashable, whatever it holds."""

    def __init__(self, value) -> None:
        self.value = value


def stand_in_actor(deaths: collections.Counter):
    def generate(request):
        if deaths[request.id] > 0:
            deaths[request.id] -= 1
            return Reference(ray.exceptions.WorkerCrashedError())
        return Reference((Completion(request.prompt.upper(), "stop", 1, 1, 1, 0, 0), None, 0.5))

    def ready_again(**options):  # the probe after a death: the stand-in is back at once
        return SimpleNamespace(remote=lambda: Reference(("restarted", None, ["target: t"])))

    return SimpleNamespace(generate=SimpleNamespace(remote=generate), ready=SimpleNamespace(options=ready_again))


def test_a_request_whose_worker_dies_twice_gets_an_error_record_and_the_job_goes_on():
    workers = RayWorkers.__new__(RayWorkers)
    deaths = collections.Counter({"once": 1, "twice": 2})
    workers.ray, workers.actors = StandInRay(), [stand_in_actor(deaths), stand_in_actor(deaths)]
    workers.reports, workers.loaded = [WorkerReport("one"), WorkerReport("two")], ["target: t"]
    requests = read_requests([json.dumps({"id": name, "prompt": name}).encode() for name in ("a", "once", "twice", "d")])
    records = []
    run_streamed(requests, workers, records.append, BatchSummary(total=4))
    assert [(r["id"], r["text"], r["error"]) for r in records] == [
        ("a", "A", None), ("once", "ONCE", None),
        ("twice", None, "line 3: the Ray worker running it died, twice (WorkerCrashedError) — the other records go "
                        "on; a request that kills its worker may need more memory per worker"),
        ("d", "D", None),
    ]
    assert sum(report.lost for report in workers.reports) == 3
    assert sum(report.records for report in workers.reports) == 3


def test_workers_that_loaded_the_models_differently_are_refused():
    same = ["target: t · cpu · float32 · int8 weights, per-token int8 activations", "draft: d · cpu · float32"]
    assert _same_everywhere([("a:1", same), ("b:2", same)]) == same
    with pytest.raises(InputError) as refused:
        _same_everywhere([("a:1", same), ("b:2", ["target: t · cpu · float32", same[1]])])
    assert refused.value.one_line() == (
        "the Ray workers loaded the models differently (a:1: target: t · cpu · float32 · int8 weights, per-token int8 "
        "activations; b:2: target: t · cpu · float32) — give --device, --dtype, --target-quant and --draft-quant so "
        "that every worker loads the same")


# ---- mistakes: one line, exit 2, nothing written -------------------------------------------------


@pytest.mark.parametrize(("flags", "error"), [
    (["--workers", "2"], "error: --workers is an option of --engine ray — add --engine ray, or leave it out"),
    (["--address", "auto"], "error: --address is an option of --engine ray — add --engine ray, or leave it out"),
    (["--engine", "spark"], "error: unknown engine 'spark' — use --engine local or --engine ray"),
    (["--engine", "ray", "--workers", "0"],
     "error: --workers must be at least 1, not 0 — give a number of Ray workers, or leave it out"),
    (["--engine", "ray", "--cpus-per-worker", "0"],
     "error: --cpus-per-worker must be more than 0, not 0 — give a number such as 1 or 2"),
    (["--engine", "ray", "--gpus-per-worker", "-1"],
     "error: --gpus-per-worker must be 0 or more, not -1 — give a number such as 1 or 0.5"),
])
def test_a_ray_option_mistake_is_one_line_and_exit_2(tmp_path, flags, error):
    (tmp_path / "in.jsonl").write_text('{"prompt": "Hi"}\n')
    result = run(tmp_path / "in.jsonl", "-o", tmp_path / "out.jsonl", *flags)
    assert_exited(result, 2)
    assert result.stderr.splitlines() == [error]
    assert not (tmp_path / "out.jsonl").exists()


def test_more_workers_than_the_cluster_holds_is_refused_in_one_line(ray_cluster, tiny_pair, tmp_path):
    (tmp_path / "in.jsonl").write_text('{"prompt": "Hi"}\n')
    result = run(tmp_path / "in.jsonl", "-o", tmp_path / "out.jsonl", *pair_args(tiny_pair), "--engine", "ray",
                 "--workers", "3")
    assert_exited(result, 2)
    assert result.stderr.splitlines()[-1] == ("error: 3 Ray workers × 1 CPU need 3 CPUs, and the cluster has 2 — use "
                                              "fewer --workers or a smaller --cpus-per-worker")


def test_without_ray_engine_ray_names_the_extra_in_one_line(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` fails as when it is not installed
    (tmp_path / "in.jsonl").write_text('{"prompt": "Hi"}\n')
    result = run(tmp_path / "in.jsonl", "-o", tmp_path / "out.jsonl", "--engine", "ray")
    assert_exited(result, 2)
    assert result.stderr.splitlines() == ["error: --engine ray needs Ray, which is not installed — pip install "
                                          "'specdec[ray]' (on every machine of the cluster)"]
    assert not (tmp_path / "out.jsonl").exists()
