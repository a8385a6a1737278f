"""Compile here, run there: the command-line pattern of the GPU benchmarks.

A script's `compile` sub-command builds its libraries on this GPU-less machine for sm_90a
(`harness.compiler`); its `run` sub-command, on the GPU machine (runtime-only TVM is enough), loads
them, writes what it prints to LOG_DIR/<name>.log and its figures to LOG_DIR/<name>.json together
with the machine's description and the command line (`Log`, `write_results`). Plots are drawn
where matplotlib is (`plot` sub-commands read the JSON).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the repository


_COMMAND = []  # the command line of this run, as `parse` saw it


def parser(doc: str, script: str):
    """(the script's parser, its sub-command group); the help is the module docstring, `script` the
    script's __file__ (for the command line the results record)."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter,
                                 prog=f"scripts/{Path(script).name}")
    return ap, ap.add_subparsers(dest="cmd", required=True)


def parse(ap, argv=None):
    """ap.parse_args(argv), remembering the command line for the logs and the result JSON."""
    argv = sys.argv[1:] if argv is None else list(argv)
    _COMMAND[:] = ["python", ap.prog, *argv]
    return ap.parse_args(argv)


def add_compile(sub, help_: str, out_help: str = "where the libraries go"):
    """A `compile` sub-command: --out (required)."""
    p = sub.add_parser("compile", help=help_)
    p.add_argument("--out", type=Path, required=True, help=out_help)
    return p


def add_run(sub, help_: str, name: str = "run", log_dir: str = "bench_logs"):
    """A sub-command that runs on the GPU machine: --log-dir, where its log and JSON go."""
    p = sub.add_parser(name, help=help_)
    p.add_argument("--log-dir", type=Path, default=Path(log_dir), help="where the log and the result JSON go")
    return p


def config_of(name: str) -> str:
    """The config a run name stands for ("lora64@cmp": lora64 on --compare-lib-dir's library;
    "lora4#2": lora4's second run in the process)."""
    return name.split("#")[0].split("@")[0]


def run_labels(names: list[str]) -> list[str]:
    """The result label of each run: a config named again is run again, as NAME#2, NAME#3, ... (the
    position in the process moves a result: repeat a config, or base at the end, to see by how much)."""
    seen: dict[str, int] = {}
    out = []
    for n in names:
        seen[n] = seen.get(n, 0) + 1
        out.append(n if seen[n] == 1 else f"{n}#{seen[n]}")
    return out


def is_base_run(label: str) -> bool:
    """A run of the base model on --lib-dir's library (base, base#2, ...; not base@cmp)."""
    return config_of(label) == "base" and not on_compare_dir(label)


def on_compare_dir(label: str) -> bool:
    """A run of --compare-lib-dir's library (NAME@cmp, NAME@cmp#2, ...)."""
    return label.split("#")[0].endswith("@cmp")


def check_run_names(names: list[str], known, compare_dir) -> None:
    """Refuse a run name whose config is not in `known` or whose suffix is not @cmp, and an @cmp
    run without --compare-lib-dir (`compare_dir` None)."""
    for name in names:
        if config_of(name) not in known or name.partition("@")[2] not in ("", "cmp"):
            raise SystemExit(f"unknown config {name!r}; choose from {', '.join(known)} (NAME@cmp: with the "
                             "libraries of --compare-lib-dir)")
        if on_compare_dir(name) and not compare_dir:
            raise SystemExit(f"config {name!r} needs --compare-lib-dir")


def gpu_runtime():
    """TVM (runtime-only is enough) with its CUDA device API loaded; torch is imported first so that
    its libcublas is the one in the process."""
    import torch  # noqa: F401  pylint: disable=import-outside-toplevel,unused-import

    from mlc_lora.runner import _tvm, load_cuda_runtime  # pylint: disable=import-outside-toplevel

    tvm = _tvm()
    load_cuda_runtime()
    return tvm


def load_cublas(device) -> None:
    from mlc_lora.runner import load_cublas as load  # pylint: disable=import-outside-toplevel

    load(device)


def machine() -> dict:
    """What the figures were taken on: host, Python, and where torch is importable its CUDA devices."""
    out = {"host": platform.node(), "platform": platform.platform(), "python": platform.python_version(),
           "cpus": os.cpu_count()}
    try:
        import torch  # pylint: disable=import-outside-toplevel
    except ImportError:
        return out
    out["torch"] = torch.__version__
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        out.update(cuda=torch.version.cuda, gpu=torch.cuda.get_device_name(0), gpu_count=torch.cuda.device_count(),
                   capability=list(torch.cuda.get_device_capability(0)), sm_count=p.multi_processor_count,
                   gpu_mem_gib=round(p.total_memory / 2 ** 30, 1))
    try:
        import triton  # pylint: disable=import-outside-toplevel

        out["triton"] = triton.__version__
    except ImportError:
        pass
    return out


GPU_FIELDS = ("clocks.sm", "temperature.gpu", "power.draw", "clocks_throttle_reasons.active")


def gpu_summary(lines) -> dict:
    """What `GpuMonitor` saw, from nvidia-smi's CSV lines of GPU_FIELDS (no header, no units): SM
    clock mean / min (MHz), temperature max (C), power mean / max (W), the throttle-reason masks
    seen other than none (a hot or power-capped GPU runs slower: a result's position in a process
    can move it)."""
    rows = []
    for line in lines:
        f = [x.strip() for x in line.split(",")]
        try:
            rows.append((float(f[0]), float(f[1]), float(f[2]), f[3]))
        except (IndexError, ValueError):
            continue  # a line nvidia-smi wrote with "[N/A]" or cut at the end
    if not rows:
        return {}
    clk, temp, power = ([r[i] for r in rows] for i in range(3))
    reasons = sorted({r[3] for r in rows if int(r[3], 16) != 0}) if all(r[3].startswith("0x") for r in rows) else []
    return dict(samples=len(rows), sm_clock_mhz_mean=round(sum(clk) / len(clk)), sm_clock_mhz_min=round(min(clk)),
                temperature_c_max=max(temp), power_w_mean=round(sum(power) / len(power), 1), power_w_max=max(power),
                throttle_reasons=reasons)


class GpuMonitor:
    """GPU 0's clock, temperature, power and throttle reasons once a second (nvidia-smi) while the
    `with` block runs; `summary` is gpu_summary's dict, {} where there is no nvidia-smi."""

    def __init__(self, period_ms: int = 1000):
        self.period_ms, self.proc, self.summary = period_ms, None, {}

    def __enter__(self):
        try:
            self.proc = subprocess.Popen(["nvidia-smi", "-i", "0", f"--query-gpu={','.join(GPU_FIELDS)}",
                                          "--format=csv,noheader,nounits", "-lms", str(self.period_ms)],
                                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        except OSError:
            self.proc = None
        return self

    def __exit__(self, *exc):
        if self.proc is not None:
            self.proc.terminate()
            out, _ = self.proc.communicate(timeout=10)
            self.summary = gpu_summary(out.splitlines())
        return False


def command_line() -> str:
    return " ".join(_COMMAND or ["python", *sys.argv])


def write_results(path: Path, payload: dict) -> Path:
    """`payload` as JSON at `path` with the machine, the command line and the time added; written to
    a temporary file first, so that a run killed mid-write keeps the previous complete file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {"machine": machine(), "command": command_line(), "time": time.strftime("%Y-%m-%d %H:%M:%S"),
           **payload}
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1))
    os.replace(tmp, path)
    return path


def read_results(paths) -> list[dict]:
    return [json.loads(Path(p).read_text()) for p in paths]


class Log:
    """Prints and appends to LOG_DIR/<name>.log, flushing each line (a killed run keeps its log)."""

    def __init__(self, log_dir: Path, name: str):
        self.dir = Path(log_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.path = self.dir / f"{name}.log"
        self.json = self.dir / f"{name}.json"
        self._f = open(self.path, "w", encoding="utf-8")  # pylint: disable=consider-using-with
        self.say(f"# {command_line()}")

    def say(self, msg: str = "") -> None:
        print(msg, flush=True)
        self._f.write(msg + "\n")
        self._f.flush()


class Lines:
    """Progress as plain lines: one at every tenth of the total and at the end."""

    def __init__(self, iterable=None, total=None, desc="", disable=False, **_):
        self.iterable, self.total, self.desc, self.n, self.disable = iterable, total, desc, 0, disable

    def __iter__(self):
        for x in self.iterable:
            yield x
            self.update()

    def update(self, k=1):
        self.n += k
        total = self.total or (len(self.iterable) if self.iterable is not None else 0)
        if not self.disable and total and (self.n == total or self.n % max(1, total // 10) == 0):
            print(f"{self.desc}: {self.n}/{total}", flush=True)

    def set_postfix(self, **_):
        pass

    def close(self):
        pass


try:
    from tqdm.auto import tqdm as _bar
except ImportError:  # the GPU machine's runtime-only environment may lack it
    _bar = None


def tqdm(*args, **kwargs):
    """Progress: tqdm's bar on a terminal; elsewhere (a log, a pipe: the GPU machine's output)
    plain lines, so that a results log holds ten lines where a bar's redraws would be thousands."""
    if _bar is not None and sys.stderr.isatty():
        return _bar(*args, **kwargs)
    return Lines(*args, **kwargs)
