"""`prime-devnet`: the whole network on one machine. Parses its config before importing anything heavy.

    prime-devnet up [--nodes 3 --validators 2 --relays 2 --model tiny|smollm2 --init CHECKPOINT --config devnet.toml ...]
    prime-devnet status [--state-dir devnet-state] [--json]
    prime-devnet down   [--state-dir devnet-state]
    prime-devnet audit  [--state-dir devnet-state] [--json]
    prime-devnet cut|heal NAME... [--state-dir devnet-state]      (--hosts netns: a partition)
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType

from protocol.errors import PrimeError

COMMANDS = {
    "up": "start anvil, deploy, the trainer with its origin, relays, validators and nodes; print a live summary",
    "status": "the process table and a summary of a running devnet (from another terminal)",
    "down": "stop a running devnet (its `up` process and every process it started)",
    "audit": "reconcile validators' ledgers, the trainer's work ledger, the nodes' records and the chain",
    "cut": "with --hosts netns: cut roles off the network (their link down; a partition), e.g. `cut node-0`",
    "heal": "with --hosts netns: bring cut roles back (`heal node-0`, or `heal --all`)",
}


class _Terminated(Exception):
    """SIGTERM: stop like on Ctrl-C."""


def _terminate(signum: int, frame: FrameType | None) -> None:
    raise _Terminated


def _usage() -> str:
    return "usage: prime-devnet COMMAND [flags]\n\ncommands:\n" + "\n".join(
        f"  {k:<7} {v}" for k, v in COMMANDS.items())


def up(argv: list[str]) -> int:
    from devnet.config import load_config

    cfg = load_config(argv)  # --help exits here
    from devnet.audit import audit
    from devnet.network import DevnetError, Layout, Network, free_port
    from devnet.observer import Observer, summary_line
    from devnet.server import Server, build_app
    from devnet.view import View

    log = logging.getLogger("prime-devnet")
    signal.signal(signal.SIGTERM, _terminate)
    try:
        net = Network(cfg)
    except DevnetError as exc:
        log.error("%s", exc)
        return 1
    server: Server | None = None
    observer: Observer | None = None
    code = 0
    try:
        port = cfg.dashboard_port or free_port()
        url = f"http://127.0.0.1:{port}"
        if net.gateway:
            print(f"prime-devnet: a host per role: namespaces on {cfg.subnet}, this process at {net.gateway} "
                  f"(record: {net.state}/hosts.json)", flush=True)
        print(f"prime-devnet: starting in {net.state} (DEV ONLY: anvil's public keys); logs in {net.state}/logs",
              flush=True)
        layout: Layout = net.up(url)
        observer = Observer(layout)
        view = View(layout, observer.snapshot, lambda: audit(layout))
        server = Server(build_app(view), port, ("127.0.0.1",) + ((net.gateway,) if net.gateway else ()))
        server.start()
        print(f"prime-devnet: up: {cfg.nodes} nodes, {cfg.validators} validators, {cfg.relays} relays, chain "
              f"{layout.rpc_url}" + (f", version 0 from {layout.init}" if layout.init else "") + "\n"
              f"prime-devnet: dashboard {' and '.join(server.urls)}  (Ctrl-C stops everything; `prime-devnet status|"
              f"audit|down --state-dir {net.state}` from another terminal)", flush=True)
        while True:
            snap = view.refresh()
            print(time.strftime("%H:%M:%S ") + summary_line(snap), flush=True)
            for e in list(net.table.exited()):
                finished = e.role == "trainer" and e.exit_code == 0
                how = "finished" if finished else f"exited with {e.exit_code}"
                print(f"prime-devnet: {e.name} {how}; its log: {e.log}", flush=True)
                if cfg.restart and not finished and e.role != "chain":
                    new = net.table.restart(e.name)
                    print(f"prime-devnet: restarted {e.name} (pid {new.pid}, restart {new.restarts})", flush=True)
            time.sleep(cfg.summary_interval_s)
    except (KeyboardInterrupt, _Terminated):
        print("\nprime-devnet: stopping every process ...", flush=True)
    except (DevnetError, PrimeError, RuntimeError) as exc:
        log.error("%s", exc)
        code = 1
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not leave half the network running
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if server is not None:
            server.stop()
        if observer is not None:
            observer.close()
        net.stop()
        alive = [e.name for e in net.table.entries.values() if e.alive() or e.group_members()]
        print(f"prime-devnet: stopped {len(net.table.entries)} processes"
              + (f"; STILL RUNNING: {alive}" if alive else ""), flush=True)
        signal.signal(signal.SIGINT, signal.default_int_handler)
    return code


def _state_args(prog: str, argv: list[str], with_json: bool = True) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=f"prime-devnet {prog}", description=COMMANDS[prog])
    p.add_argument("--state-dir", type=Path, default=Path("devnet-state"), help="the devnet's state directory")
    if with_json:
        p.add_argument("--json", action="store_true", help="print JSON")
    return p.parse_args(argv)


def status(argv: list[str]) -> int:
    args = _state_args("status", argv)
    from devnet.network import Layout
    from devnet.observer import Observer, summary_line
    from devnet.processes import ProcessTable, proc_start_time

    header, entries = ProcessTable.read(args.state_dir)
    if not entries:
        print(f"no devnet in {args.state_dir}", file=sys.stderr)
        return 1
    sup = header.get("supervisor")
    running = sup is not None and proc_start_time(int(sup)) == header.get("supervisor_start_time")
    snap = None
    if running and (args.state_dir / "devnet.json").exists():
        observer = Observer(Layout.load(args.state_dir))
        try:
            snap = observer.snapshot()
        finally:
            observer.close()
    from devnet.published import published_lines, published_versions

    published = published_versions(args.state_dir / "origin")
    if args.json:
        print(json.dumps({"running": running, "supervisor": sup, "processes": [e.__dict__ for e in entries],
                          "snapshot": snap, "published": published}, indent=1, default=str))
        return 0
    print(f"devnet in {args.state_dir}: {'running' if running else 'not running'} (supervisor pid {sup})")
    print(f"{'name':<13} {'role':<10} {'pid':>7} {'port':>6}  {'state':<8} log")
    for e in entries:
        state = "alive" if e.alive() else ("exit " + str(e.exit_code) if e.exit_code is not None else "gone")
        print(f"{e.name:<13} {e.role:<10} {e.pid:>7} {e.port or '':>6}  {state:<8} {e.log}")
    if snap is not None:
        print(summary_line(snap))
        if snap.get("dashboard"):
            print(f"dashboard: {snap['dashboard']}")
    print("\n".join(published_lines(published)))
    return 0


def down(argv: list[str]) -> int:
    args = _state_args("down", argv, with_json=False)
    from devnet.processes import ProcessTable, running, stop_groups

    header, entries = ProcessTable.read(args.state_dir)
    if not entries:
        from devnet.hosts import HostsError, teardown

        try:  # a run that died after making its namespaces and before starting a process
            removed = teardown(args.state_dir)
        except HostsError as exc:
            print(str(exc), file=sys.stderr)
            return 1
        print(f"no devnet in {args.state_dir}" + (f"; removed {len(removed)} namespaces/links" if removed else ""))
        return 0
    sup = header.get("supervisor")
    if sup is not None and running(int(sup), header.get("supervisor_start_time")):
        print(f"stopping the devnet supervisor (pid {sup}) ...", flush=True)
        os.kill(int(sup), signal.SIGTERM)
        deadline = time.monotonic() + 120
        # an exited supervisor whose parent has not reaped it yet (a zombie) is done: do not wait on it
        while time.monotonic() < deadline and running(int(sup), header.get("supervisor_start_time")):
            time.sleep(0.2)
    _, entries = ProcessTable.read(args.state_dir)
    left = [e for e in entries if e.alive() or e.group_members()]
    killed = stop_groups(left) if left else []
    still = [e.name for e in entries if e.alive() or e.group_members()]
    removed = []
    if not still:  # a namespace outlives its record only while a process is in it: remove them after the roles
        from devnet.hosts import HostsError, teardown

        try:
            removed = teardown(args.state_dir)
        except HostsError as exc:
            still.append(str(exc))
    print(f"devnet down: {len(entries)} processes"
          + (f"; stopped directly: {[e.name for e in left]}" if left else "")
          + (f" (SIGKILL: {killed})" if killed else "") + (f"; removed {len(removed)} namespaces/links" if removed
                                                            else "") + (f"; STILL RUNNING: {still}" if still else ""))
    return 1 if still else 0


def audit_cmd(argv: list[str]) -> int:
    args = _state_args("audit", argv)
    from devnet.audit import audit, table
    from devnet.network import Layout

    try:
        layout = Layout.load(args.state_dir)
    except OSError as exc:
        print(f"no devnet layout in {args.state_dir}: {exc}", file=sys.stderr)
        return 2
    report = audit(layout)
    print(json.dumps(report, indent=1, default=str) if args.json else table(report))
    return 0 if report["ok"] else 1


def partition(command: str, argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog=f"prime-devnet {command}", description=COMMANDS[command])
    p.add_argument("--state-dir", type=Path, default=Path("devnet-state"), help="the devnet's state directory")
    p.add_argument("names", nargs="*", help="roles (processes.json names: node-0, validator-1, relay-0, trainer ...)")
    if command == "heal":
        p.add_argument("--all", action="store_true", help="every role")
    args = p.parse_args(argv)
    from devnet.hosts import HostPlan, HostsError, set_link

    plan = HostPlan.load(args.state_dir)
    if plan is None:
        print(f"no separate hosts in {args.state_dir} (start it with `prime-devnet up --hosts netns`)", file=sys.stderr)
        return 2
    names = [h.name for h in plan.hosts] if getattr(args, "all", False) else args.names
    unknown = [n for n in names if n not in {h.name for h in plan.hosts}]
    if unknown or not names:
        print(f"name roles among {[h.name for h in plan.hosts]}" + (f"; unknown: {unknown}" if unknown else ""),
              file=sys.stderr)
        return 2
    try:
        for name in names:
            set_link(plan, name, up=command == "heal")
    except HostsError as exc:
        print(str(exc), file=sys.stderr)
        return 1
    print(f"{'healed' if command == 'heal' else 'cut off'}: {', '.join(names)}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(_usage())
        return 0
    command, rest = args[0], args[1:]
    handlers: dict[str, Callable[[list[str]], int]] = {
        "up": up, "status": status, "down": down, "audit": audit_cmd,
        "cut": functools.partial(partition, "cut"), "heal": functools.partial(partition, "heal")}
    if command not in handlers:
        print(f"prime-devnet: unknown command {command!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO if command == "up" else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    try:
        return handlers[command](rest)
    except PrimeError as exc:
        logging.getLogger("prime-devnet").error("%s: %s", type(exc).__name__, exc)
        return 2


if __name__ == "__main__":
    sys.exit(main())
