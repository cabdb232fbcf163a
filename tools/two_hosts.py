#!/usr/bin/env python3
"""Two hosts on one machine: two network namespaces joined by a veth pair, a command run on each.

    python tools/two_hosts.py -- 'torchrun --nnodes 2 --node-rank $NODE_RANK --nproc-per-node 1 \\
        --rdzv-backend c10d --rdzv-endpoint $HOST0:29400 --rdzv-id demo \\
        train/clip.py name=two_hosts train.max_steps=6 data.workers=0'
    python tools/two_hosts.py --timeout 600 --log-dir runs/two_hosts_logs -- 'CMD'   # bounded, logs per node
    python tools/two_hosts.py --node1 'CMD FOR NODE 1' -- 'CMD FOR NODE 0'           # different commands
    python tools/two_hosts.py --check                                                # can this machine do it?

Each host is a network namespace with one end of a veth pair (node0 = 10.231.0.1, node1 =
10.231.0.2 on a /24 that exists only between these two namespaces: nothing else on any network is
contacted), its own loopback, its own UTS namespace with hostname node0 / node1 and its own
/etc/hosts that names both, like two machines of a cluster that share a file system (the working
directory, the run folders). The link device is called `mcnet` on both hosts (for
GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME). The command runs under `bash -c` on each host with
NODE_RANK (0/1), NODE_NAME, NODE_ADDR, HOST0 and HOST1 exported; output lines are prefixed with
`[node0]` / `[node1]` (and written to --log-dir/nodeN.log when given).

Everything is torn down on exit, also on failure, a timeout, Ctrl-C or SIGTERM: every process
left on either host is killed (SIGKILL, by pid: `ip netns pids`), the namespaces and the link are
deleted, the hosts files removed. Namespaces left by a run that was itself SIGKILLed are removed
by the next run (their names carry the pid of the tool that made them).

Exit status: 0 when both commands succeeded; otherwise the first failing node's status (both are
printed); 124 after --timeout (--kill-on-bad-exit: a failing host takes the other down at once, as
`srun --kill-on-bad-exit=1` does on a cluster); 77 when namespaces cannot be created here (not root, no
CAP_NET_ADMIN, no `ip`/`unshare`, or a container that forbids it) -- tests skip on 77 with the
printed reason. Needs root (CI runs as root).

As a module (tests): `with TwoHosts() as hosts: p = hosts.popen(0, "cmd", log=path)`;
`hosts.kill(1)` kills every process of host 1 (a node lost), `hosts.wait(procs, timeout)`.
"""

from __future__ import annotations

import argparse
import itertools
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import IO, Sequence

NO_NAMESPACES_EXIT = 77  # automake's "skipped"
TIMEOUT_EXIT = 124       # like timeout(1)
SUBNET = "10.231.0"      # the project's own test hosts: .1 and .2
LINK = "mcnet"           # the link device's name on both hosts
NAME_PREFIX = "mc2h"     # namespaces are named mc2h-<pid>-<n>-node<r>
_STALE = re.compile(rf"^{NAME_PREFIX}-(\d+)-\d+-node\d$")
_counter = itertools.count()

# runs on each host under `ip netns exec NS unshare --uts`: the host's own name and /etc/hosts (the
# bind mount stays inside the mount namespace that `ip netns exec` made for this command)
_PROLOGUE = 'hostname "$NODE_NAME" && mount --bind "$MC2H_HOSTS" /etc/hosts && unset MC2H_HOSTS && exec bash -c "$MC2H_COMMAND"'


class NamespacesUnavailable(RuntimeError):
    """Network namespaces cannot be created on this machine (the reason is the message)."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and proc.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {proc.stderr.strip() or proc.returncode}")
    return proc


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def namespace_pids(ns: str) -> list[int]:
    proc = _ip("netns", "pids", ns, check=False)
    return [int(p) for p in proc.stdout.split()] if proc.returncode == 0 else []


def _remove_namespace(ns: str) -> None:
    """Kill every process of a namespace (by pid; SIGKILL), then delete it (and its end of the link)."""
    for _ in range(50):
        pids = namespace_pids(ns)
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.05)
    _ip("netns", "del", ns, check=False)


def remove_stale() -> list[str]:
    """Delete this tool's namespaces whose creator is gone (a run that was SIGKILLed)."""
    listing = _ip("netns", "list", check=False).stdout
    removed = []
    for line in listing.splitlines():
        name = line.split()[0] if line.split() else ""
        found = _STALE.match(name)
        if found and not _alive(int(found.group(1))):
            _remove_namespace(name)
            removed.append(name)
    for folder in Path(tempfile.gettempdir()).glob(f"{NAME_PREFIX}-*-*-*"):  # their hosts files
        pid = folder.name.split("-")[1]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(folder, ignore_errors=True)
    return removed


class TwoHosts:
    """Two namespaced hosts joined by a veth pair; a context manager that always tears them down."""

    def __init__(self, subnet: str = SUBNET, names: Sequence[str] = ("node0", "node1"), same_hostname: bool = False):
        self.tag = f"{NAME_PREFIX}-{os.getpid()}-{next(_counter)}"
        self.namespaces = [f"{self.tag}-node{r}" for r in (0, 1)]
        self.addresses = [f"{subnet}.1", f"{subnet}.2"]
        # same_hostname: both hosts keep this machine's name (the set-up in which torchrun's c10d
        # rendezvous cannot tell which host should serve its store)
        self.names = [os.uname().nodename] * 2 if same_hostname else list(names)
        self.same_hostname = same_hostname
        self._tmp: Path | None = None
        self._procs: list[subprocess.Popen] = []

    # ------------------------------------------------------------------ set-up and teardown
    def __enter__(self) -> "TwoHosts":
        self.up()
        return self

    def __exit__(self, *exc: object) -> None:
        self.down()

    def up(self) -> None:
        for tool in ("ip", "unshare", "mount", "hostname"):
            if shutil.which(tool) is None:
                raise NamespacesUnavailable(f"`{tool}` is not installed")
        try:
            remove_stale()
            first = _ip("netns", "add", self.namespaces[0], check=False)
        except (OSError, subprocess.SubprocessError) as exn:
            raise NamespacesUnavailable(f"ip netns: {exn}") from None
        if first.returncode != 0:
            raise NamespacesUnavailable(f"`ip netns add` failed: {first.stderr.strip()} (needs root / CAP_NET_ADMIN)")
        try:
            ns0, ns1 = self.namespaces
            _ip("netns", "add", ns1)
            _ip("link", "add", LINK, "netns", ns0, "type", "veth", "peer", "name", LINK, "netns", ns1)
            for ns, addr in zip(self.namespaces, self.addresses):
                _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", LINK)
                _ip("-n", ns, "link", "set", LINK, "up")
                _ip("-n", ns, "link", "set", "lo", "up")
            self._tmp = Path(tempfile.mkdtemp(prefix=f"{self.tag}-"))
            ours = "" if self.same_hostname else "".join(f"{a} {n}\n" for a, n in zip(self.addresses, self.names))
            for r in (0, 1):  # the two names first, then this machine's own entries
                (self._tmp / f"hosts{r}").write_text(ours + Path("/etc/hosts").read_text())
            # an unprivileged container may allow `ip netns add` but not the rest: find out now
            probe = self.run(1, f"{shlex.quote(sys.executable)} -c 'import socket; "
                                f"socket.create_connection((\"{self.addresses[0]}\", 9), 3)' "
                                "2>&1 | grep -q 'Connection refused' && hostname", timeout=30)
            if probe.returncode != 0 or probe.stdout.strip() != self.names[1]:
                raise NamespacesUnavailable(f"the two hosts cannot reach each other: {probe.stdout.strip()[-300:]}")
        except NamespacesUnavailable:
            self.down()
            raise
        except (RuntimeError, OSError, subprocess.SubprocessError) as exn:
            self.down()
            raise NamespacesUnavailable(f"setting up the two hosts failed: {exn}") from None

    def down(self) -> None:
        for p in self._procs:  # each command's own process group first, then whatever else is on the hosts
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
        for ns in self.namespaces:
            _remove_namespace(ns)
        for p in self._procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None

    # ------------------------------------------------------------------ running commands
    def _argv(self, node: int) -> list[str]:
        return ["ip", "netns", "exec", self.namespaces[node], "unshare", "--uts", "--", "bash", "-c", _PROLOGUE]

    def env(self, node: int, extra: dict[str, str] | None = None) -> dict[str, str]:
        assert self._tmp is not None, "TwoHosts is not up"
        return {**os.environ, **(extra or {}), "NODE_RANK": str(node), "NODE_NAME": self.names[node],
                "NODE_ADDR": self.addresses[node], "HOST0": self.addresses[0], "HOST1": self.addresses[1],
                "MC2H_HOSTS": str(self._tmp / f"hosts{node}")}

    def popen(self, node: int, command: str | Sequence[str], *, env: dict[str, str] | None = None,
              log: Path | IO | None = None, cwd: str | Path | None = None) -> subprocess.Popen:
        """Start `command` (a shell string, or argv) on host `node`; output to `log` (a path or file)."""
        command = command if isinstance(command, str) else shlex.join(command)
        out: IO | int | None = open(log, "w") if isinstance(log, (str, Path)) else log
        try:
            proc = subprocess.Popen(self._argv(node), env={**self.env(node, env), "MC2H_COMMAND": command}, cwd=cwd,
                                    stdout=out, stderr=subprocess.STDOUT if out is not None else None,
                                    stdin=subprocess.DEVNULL, start_new_session=True)
        finally:
            if isinstance(log, (str, Path)) and out is not None:
                out.close()  # the child holds its own copy
        self._procs.append(proc)
        return proc

    def run(self, node: int, command: str, timeout: float, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
        proc = subprocess.run(self._argv(node), env={**self.env(node, env), "MC2H_COMMAND": command},
                              capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
        return proc

    def kill(self, node: int, sig: int = signal.SIGKILL) -> list[int]:
        """Signal every process on host `node` (SIGKILL: the node is lost). Returns the pids."""
        pids = namespace_pids(self.namespaces[node])
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        return pids

    @staticmethod
    def wait(procs: Sequence[subprocess.Popen], timeout: float) -> list[int | None]:
        """Wait for every process until `timeout` s have passed; None for one still running."""
        deadline = time.monotonic() + timeout
        for p in procs:
            try:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        return [p.poll() for p in procs]


# ---------------------------------------------------------------------- command line


def _pump(stream: IO[bytes], prefix: str, log: IO[str] | None) -> None:
    for raw in iter(stream.readline, b""):
        line = raw.decode(errors="replace")
        sys.stdout.write(f"{prefix} {line}")
        sys.stdout.flush()
        if log is not None:
            log.write(line)
            log.flush()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", nargs="*", help="shell command run on both hosts (after --)")
    parser.add_argument("--node1", default=None, help="another command for host 1")
    parser.add_argument("--timeout", type=float, default=None, help="kill both hosts after this many seconds (exit 124)")
    parser.add_argument("--log-dir", default=None, help="also write node0.log / node1.log here")
    parser.add_argument("--subnet", default=SUBNET, help=f"the hosts' /24 (default {SUBNET}: .1 and .2)")
    parser.add_argument("--same-hostname", action="store_true",
                        help="keep this machine's hostname on both hosts (reproduces a shared-hostname set-up)")
    parser.add_argument("--check", action="store_true", help="only set up, test the link and tear down")
    parser.add_argument("--kill-on-bad-exit", action="store_true",
                        help="when a host's command fails, kill the other host at once (as srun --kill-on-bad-exit=1)")
    args = parser.parse_args(argv)
    command = " ".join(args.command)
    if not command and not args.check:
        parser.error("give a command after --, or --check")

    def stop(signum: int, frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):  # also when started with SIGINT ignored (from `cmd &`)
        signal.signal(sig, stop)
    hosts = TwoHosts(subnet=args.subnet, same_hostname=args.same_hostname)
    try:
        hosts.up()
    except NamespacesUnavailable as exn:
        print(f"two_hosts: cannot create network namespaces here: {exn}", file=sys.stderr)
        return NO_NAMESPACES_EXIT
    try:
        print(f"two_hosts: {hosts.names[0]} = {hosts.addresses[0]}, {hosts.names[1]} = {hosts.addresses[1]} "
              f"(namespaces {', '.join(hosts.namespaces)})", file=sys.stderr)
        if args.check:
            return 0
        logs = []
        if args.log_dir:
            Path(args.log_dir).mkdir(parents=True, exist_ok=True)
            logs = [open(Path(args.log_dir) / f"node{r}.log", "w") for r in (0, 1)]
        procs = [hosts.popen(r, args.node1 if (r == 1 and args.node1) else command, log=subprocess.PIPE)
                 for r in (0, 1)]
        pumps = [threading.Thread(target=_pump, args=(p.stdout, f"[node{r}]", logs[r] if logs else None),
                                  daemon=True) for r, p in enumerate(procs)]
        for t in pumps:
            t.start()
        deadline = time.monotonic() + (args.timeout if args.timeout is not None else float("inf"))
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            failed = [r for r, p in enumerate(procs) if p.poll() not in (None, 0)]
            if args.kill_on_bad_exit and failed and any(p.poll() is None for p in procs):
                print(f"two_hosts: node{failed[0]} failed; killing the other host (--kill-on-bad-exit)", file=sys.stderr)
                for r, p in enumerate(procs):
                    if p.poll() is None:
                        hosts.kill(r)
                hosts.wait(procs, 10)
                break
            time.sleep(0.1)
        codes = [p.poll() for p in procs]
        timed_out = any(c is None for c in codes)
        if timed_out:
            print(f"two_hosts: timeout after {args.timeout:.0f} s; killing both hosts", file=sys.stderr)
            return TIMEOUT_EXIT
        for t in pumps:
            t.join(5)
        for r, c in enumerate(codes):
            print(f"two_hosts: node{r} ({hosts.names[r]}) exited with status {c}", file=sys.stderr)
        return next((c for c in codes if c), 0)
    except KeyboardInterrupt:
        print("two_hosts: interrupted; tearing down both hosts", file=sys.stderr)
        return 130
    finally:
        hosts.down()


if __name__ == "__main__":
    sys.exit(main())
