"""The GPU paths the CPU cannot show, checked on a lent NVIDIA machine (tools/device_check.sh
runs this beside the llama-server build; each check writes what it saw and carries on).

    python tools/device_gpu_paths.py attribution --out DIR
    python tools/device_gpu_paths.py cpu-only --out DIR --server PATH --model GGUF
    python tools/device_gpu_paths.py mps --out DIR

attribution  A CUDA process (torch) in a pod-shaped cgroup (`kubepods.slice/kubepods-besteffort
             .slice/kubepods-besteffort-pod<uid>.slice/cri-containerd-<id>.scope`), and the node
             agent's probe (real NVML) run from a sibling pod's cgroup, in a cgroup namespace of
             its own rooted there (as containerd's CRI gives a container on cgroup v2), as the
             agent image's user (65533): is the process's GPU memory charged to the pod's Engine?
cpu-only     The image's build of llama-server (GGML_BACKEND_DL, shared libraries) started with
             the CUDA driver library hidden (a mount namespace binds /dev/null over every
             libcuda.so*: what NVIDIA_VISIBLE_DEVICES=void leaves a container): `ldd` of the
             server and of libggml-cuda.so, whether it serves /health, which backends it loaded.
mps          An MPS control daemon of this check's own (pipe directory under --out's work dir,
             quit at the end) with a default pinned limit of a quarter of GPU 0; a CUDA client
             allocates with CUDA_MPS_PINNED_DEVICE_MEM_LIMIT below and above that default: does
             the allocation above it succeed (may a client raise its limit over the daemon's
             default?), and which NVML list (compute, MPS compute) names the client's pid.

Each writes <check>.json under --out: what ran, what it saw, and `verdict`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT / "operator") not in sys.path:
    sys.path.insert(0, str(ROOT / "operator"))

AGENT_UID = 65533
MIB = 1 << 20
#: A CUDA client that holds `MiB` of device memory until stdin closes, printing its pid first.
CLIENT = """
import os, sys
mib = int(sys.argv[1])
print(os.getpid(), flush=True)
try:
    import torch
    held = torch.empty(mib * 2**20, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    print("allocated", mib, flush=True)
except Exception as err:
    print("failed", type(err).__name__, str(err).splitlines()[0][:300], flush=True)
sys.stdin.read()
"""


def run(cmd: list[str], timeout: float = 60, **kw: Any) -> dict[str, Any]:
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)
        return {
            "cmd": cmd[:6],
            "rc": p.returncode,
            "out": p.stdout[-4000:],
            "err": p.stderr[-4000:],
        }
    except (OSError, subprocess.TimeoutExpired) as err:
        return {"cmd": cmd[:6], "rc": None, "err": f"{type(err).__name__}: {err}"}


def write(out: Path, name: str, doc: dict[str, Any]) -> None:
    (out / f"{name}.json").write_text(json.dumps(doc, indent=2, default=str))
    print(f"{name}: {doc.get('verdict')}")


def start_client(mib: int, env: dict[str, str] | None = None) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", CLIENT, str(mib)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, **(env or {})},
    )  # fmt: skip
    assert proc.stdout is not None
    pid = proc.stdout.readline().strip()
    status = proc.stdout.readline().strip()  # "allocated N" or "failed ..."
    return proc, f"pid {pid}: {status}"


def stop(proc: subprocess.Popen[str]) -> None:
    with contextlib.suppress(OSError, ValueError):
        assert proc.stdin is not None
        proc.stdin.close()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()


def nvml_lists(pid: int) -> dict[str, Any]:
    """Which of NVML's process lists name `pid`, GPU by GPU (as the agent asks them)."""
    import pynvml

    pynvml.nvmlInit()
    try:
        seen: dict[str, Any] = {}
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            for name in (
                "nvmlDeviceGetComputeRunningProcesses",
                "nvmlDeviceGetMPSComputeRunningProcesses",
                "nvmlDeviceGetGraphicsRunningProcesses",
            ):
                try:
                    pids = [p.pid for p in getattr(pynvml, name)(h)]
                except Exception as err:  # NVMLError, NVMLLibraryMismatchError
                    seen[f"{name}[{i}] error"] = f"{type(err).__name__}: {err}"
                    continue
                if pid in pids:
                    seen.setdefault(name, []).append(i)
        return seen
    finally:
        pynvml.nvmlShutdown()


# --- attribution --------------------------------------------------------------------------


def _cgroup_v2_root() -> Path | None:
    for root in (Path("/sys/fs/cgroup"), Path("/sys/fs/cgroup/unified")):
        if (root / "cgroup.controllers").exists():
            return root
    return None


AGENT_READ = """
import json, sys
from pathlib import Path
from continuum_operator.agent import probe
placed = json.loads(sys.argv[1])
settings = probe.ProbeSettings(cgroup_root=Path(sys.argv[2]), scan_environ=False)
doc, _ = probe.capture(settings, placed_pods=placed)
owners = probe.readings(doc).gpu_owners
print(json.dumps({
    "cgroup": {pid: e["cgroup"] for pid, e in doc["attribution"]["processes"].items()},
    "owners": {str(p): [o.kind, o.namespace, o.name] for p, o in owners.items()},
    "gpu_pids": probe.gpu_pids(doc["nvml"]),
    "client_as_seen": Path(f"/proc/{sys.argv[3]}/cgroup").read_text(),
}))
"""


def attribution(out: Path) -> None:
    doc: dict[str, Any] = {"check": "attribution"}
    root = _cgroup_v2_root()
    if root is None or not os.access(root, os.W_OK):
        doc["verdict"] = f"skipped: no writable cgroup v2 hierarchy ({root})"
        return write(out, "attribution", doc)
    uid = str(uuid.uuid4())
    qos = root / "kubepods.slice" / "kubepods-besteffort.slice"
    engine_cg = (
        qos / f"kubepods-besteffort-pod{uid.replace('-', '_')}.slice" / "cri-containerd-e.scope"
    )
    agent_cg = (
        qos
        / f"kubepods-besteffort-pod{uuid.uuid4().hex[:8]}_0000_0000_0000_000000000000.slice"
        / "cri-containerd-a.scope"
    )
    client = None
    try:
        for cg in (engine_cg, agent_cg):
            cg.mkdir(parents=True, exist_ok=True)
        client, status = start_client(256)
        pid = int(status.split()[1].rstrip(":"))
        (engine_cg / "cgroup.procs").write_text(str(pid))
        doc["client"] = status
        doc["client_cgroup"] = Path(f"/proc/{pid}/cgroup").read_text()
        placed = [{"uid": uid, "kind": "Engine", "namespace": "dc", "name": "engine"}]
        # Join the agent's cgroup, make a namespace rooted there, drop to the agent's user.
        script = (
            f"echo $$ > {agent_cg}/cgroup.procs && exec unshare --cgroup "
            f"setpriv --reuid {AGENT_UID} --regid {AGENT_UID} --clear-groups "
            f'{sys.executable} -c "$0" "$@"'
        )
        env = {
            **os.environ,
            "PYTHONPATH": f"{ROOT / 'operator'}:{os.environ.get('PYTHONPATH', '')}",
        }
        seen = run(
            ["sh", "-c", script, AGENT_READ, json.dumps(placed), str(root), str(pid)], env=env
        )
        doc["agent_read"] = seen
        read = json.loads(seen["out"]) if seen.get("rc") == 0 else {}
        doc["as_the_agent_saw_it"] = read
        owner = read.get("owners", {}).get(str(pid))
        doc["verdict"] = (
            "attributed: the pod's GPU process is Engine dc/engine's"
            if owner == ["Engine", "dc", "engine"]
            else f"NOT attributed (owner {owner}; gpu pids {read.get('gpu_pids')})"
        )
    except Exception as err:  # record and carry on
        doc["verdict"] = f"failed: {type(err).__name__}: {err}"
    finally:
        if client is not None:
            stop(client)
        for cg in (engine_cg, agent_cg):
            with contextlib.suppress(OSError):
                cg.rmdir()
                cg.parent.rmdir()
        with contextlib.suppress(OSError):
            qos.rmdir()
            qos.parent.rmdir()
    write(out, "attribution", doc)


# --- the image's CPU-only path --------------------------------------------------------------


def _libcuda_paths() -> list[str]:
    found = run(["ldconfig", "-p"]).get("out", "")
    paths = {line.split("=>")[-1].strip() for line in found.splitlines() if "libcuda.so" in line}
    return sorted(p for p in paths if Path(p).exists())


def cpu_only(out: Path, server: Path, model: Path) -> None:
    doc: dict[str, Any] = {"check": "cpu-only", "server": str(server)}
    cuda_module = next(iter(sorted(server.parent.glob("libggml-cuda*.so"))), None)
    doc["ldd_server"] = run(["ldd", str(server)]).get("out")
    doc["ldd_ggml_cuda"] = run(["ldd", str(cuda_module)]).get("out") if cuda_module else None
    libcuda = _libcuda_paths()
    doc["libcuda_hidden"] = libcuda
    hide = "".join(f"mount --bind /dev/null {p}; " for p in libcuda)
    port = 18000 + os.getpid() % 1000
    log = out / "cpu-only-server.log"
    script = f"{hide}exec {server} -m {model} --host 127.0.0.1 --port {port} -ngl 0 -c 512 -lv 4"
    with log.open("w") as sink:
        proc = subprocess.Popen(["unshare", "-m", "sh", "-c", script], stdout=sink, stderr=sink)
    healthy = False
    try:
        for _ in range(60):
            if proc.poll() is not None:
                break
            url = f"http://127.0.0.1:{port}/health"
            with contextlib.suppress(OSError), urllib.request.urlopen(url, timeout=2) as r:
                healthy = r.status == 200
            if healthy:
                break
            time.sleep(1)
    finally:
        proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=10)
    text = log.read_text(errors="replace")
    doc["exit"] = proc.returncode
    doc["backend_lines"] = [
        line for line in text.splitlines() if "backend" in line.lower() or "CUDA" in line
    ][:40]
    doc["verdict"] = (
        f"served /health with the driver library hidden ({len(libcuda)} hidden)"
        if healthy
        else f"did NOT serve /health with the driver hidden (exit {proc.returncode}; see log)"
    )
    write(out, "cpu-only", doc)


# --- MPS -----------------------------------------------------------------------------------


def _mps(control: str, pipe: Path, command: str) -> dict[str, Any]:
    env = {**os.environ, "CUDA_MPS_PIPE_DIRECTORY": str(pipe), "CUDA_MPS_LOG_DIRECTORY": str(pipe)}
    return run([control], input=command + "\n", env=env, timeout=20)


def mps(out: Path) -> None:
    doc: dict[str, Any] = {"check": "mps"}
    control = shutil.which("nvidia-cuda-mps-control")
    if control is None:
        doc["verdict"] = "skipped: no nvidia-cuda-mps-control on this machine"
        return write(out, "mps", doc)
    import pynvml

    pynvml.nvmlInit()
    total = pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(0)).total
    pynvml.nvmlShutdown()
    default_mib = total // MIB // 4
    pipe = Path(tempfile.mkdtemp(prefix="mps-"))
    env = {"CUDA_MPS_PIPE_DIRECTORY": str(pipe), "CUDA_MPS_LOG_DIRECTORY": str(pipe),
           "CUDA_VISIBLE_DEVICES": "0"}  # fmt: skip
    doc["start"] = run([control, "-d"], env={**os.environ, **env})
    try:
        doc["default_limit"] = _mps(
            control, pipe, f"set_default_device_pinned_mem_limit 0 {default_mib}M"
        )
        doc["default_limit_mib"] = default_mib
        cases = {
            "below the default": (default_mib // 2, default_mib // 2 - 512),
            "above the default": (default_mib * 2, default_mib * 2 - 512),
            "no client limit, above the default": (None, default_mib + 1024),
        }
        results: dict[str, Any] = {}
        for name, (limit, alloc) in cases.items():
            client_env = dict(env)
            if limit is not None:
                client_env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] = f"0={limit}M"
            proc, status = start_client(alloc, client_env)
            pid = int(status.split()[1].rstrip(":"))
            results[name] = {
                "limit_mib": limit,
                "allocated_mib": alloc,
                "client": status,
                "nvml_lists_naming_it": nvml_lists(pid),
                "server_list": _mps(control, pipe, "get_server_list").get("out"),
            }
            stop(proc)
        doc["cases"] = results
        above = results["above the default"]["client"]
        doc["verdict"] = (
            "a client's limit above the daemon's default HOLDS (allocation above the default "
            "succeeded)"
            if "allocated" in above
            else "a client's limit above the daemon's default does NOT raise it (allocation failed)"
        )
    except Exception as err:
        doc["verdict"] = f"failed: {type(err).__name__}: {err}"
    finally:
        doc["quit"] = _mps(control, pipe, "quit")
        shutil.rmtree(pipe, ignore_errors=True)
    write(out, "mps", doc)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("check", choices=("attribution", "cpu-only", "mps"))
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--server", type=Path)
    p.add_argument("--model", type=Path)
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.check == "attribution":
        attribution(args.out)
    elif args.check == "mps":
        mps(args.out)
    else:
        if args.server is None or args.model is None:
            p.error("cpu-only needs --server and --model")
        cpu_only(args.out, args.server, args.model)
    return 0


if __name__ == "__main__":
    sys.exit(main())
