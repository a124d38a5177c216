"""`make hub-rehearsal`: a workshop's first minute on the rehearsal hub. A room of attendees logs in and starts their
labs within the same minute, on the virtual cluster's real Slurm, while a job from before the workshop still holds
one node's GPUs: the labs that find no free GPU wait in the queue, and their spawn page says so, until it ends.

    make hub-rehearsal                              # 12 attendees, 3 nodes of 4 GPUs and 4 cores, one lab per GPU
    PYTHONPATH=tools .venv/bin/python -m hub.load --attendees 20 --nodes 5

Each attendee is a client of their own doing what their browser does (tests/test_hub.py drives real browsers for
two): the login form, the spawn page's progress stream (the messages the page shows, SlurmJobSpawner.progress), and
their lab's page through the hub's proxy and OAuth, which comes only once JupyterLab runs. Printed, and appended
to results/hub/hub_load.jsonl with the hardware, versions and date: each lab's seconds from the login to its page,
the median and the worst, Slurm's queue wait and JupyterLab's start, what a waiting lab's page said, and the labs
lost (0 is the bar).
Then a compute node is lost (lose_node: a power cut on the last node, whose labs are the queued ones): Slurm marks
it down and ends its labs' jobs, the hub notices, each of its attendees' lab URL says how the job ended and offers a
new lab, the node comes back, and every one of them starts a new lab. The seconds of each step are in the record.
A lab that fails says why (its page's last message). Afterwards no job, attendee process, account, hub process,
port or node is left; the run fails (exit 1) if one is, if a lab did not start, or if a lab lost with its node
was not noticed or not started again. tests/test_hub_controls.py shows both failing on a hub that breaks them.
"""
from __future__ import annotations

import argparse
import contextlib
import html
import json
import os
import re
import statistics
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import asdict, dataclass, field
from http.cookiejar import CookieJar
from pathlib import Path

from . import rehearsal

ROOT = rehearsal.HERE.parents[1]
# Beside the benchmarks' files, in a folder of its own: 07 lists every kind of results/*.jsonl in a compared output.
RESULTS = ROOT / "results" / "hub"
BLOCKER_S = 40  # the earlier job holds its node's GPUs this long after the room has logged in
QUEUED_S = 10.0  # a job pending longer than a few of Slurm's scheduling passes waited for GPUs (the page said PENDING)
# From a node's power cut to the hub's notice of its labs: Slurm's SlurmdTimeout (30 s on the virtual cluster; sites
# often keep the default, 300 s) and its pings, then one poll of the hub (30 s).
NOTICE_S = 150


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # bad input: one line and exit code 2, as every command of the workbook
        print(f"error: {message} (see make hub-rehearsal's --help)", file=sys.stderr)
        raise SystemExit(2)


@dataclass
class Lab:
    """What one attendee saw, from the login to their lab answering."""
    name: str
    messages: list = field(default_factory=list)  # [seconds since the login, the spawn page's message]
    queued: str = ""                                # the page's first message while the job waited in the queue
    queue_s: float | None = None                    # from that message to the page's "is running on" (Slurm's wait)
    start_s: float | None = None                    # from "is running on" to the hub's "ready" (JupyterLab's start)
    seconds: float | None = None                    # from the login to the lab's page; None: no lab
    failed: str = ""                                # why there is no lab (the page's last message, or the error)
    job: str = ""
    node: str = ""


class Attendee:
    """One attendee's browser as far as the hub can tell: a cookie jar and the requests a browser makes."""

    def __init__(self, url: str, name: str, password: str):
        self.url, self.name, self.password = url, name, password
        self.http = urllib.request.build_opener(urllib.request.HTTPCookieProcessor(CookieJar()))
        self.lab = Lab(name)
        self.first = self.lab  # the lab of the login; start_again replaces self.lab

    def get(self, path: str, timeout: float = 60) -> tuple[str, str]:
        with self.http.open(self.url + path, timeout=timeout) as answer:
            return answer.geturl().removeprefix(self.url), answer.read().decode("utf-8", "replace")

    def start(self, start_timeout: float) -> None:
        """Log in on the hub's page (the form, with its xsrf field), which starts the lab; follow the progress stream
        the spawn page reads until the hub says the lab is ready or failed; then ask the lab itself."""
        try:
            _, page = self.get("/hub/login")
            xsrf = re.search(r'name="_xsrf" value="([^"]+)"', page)
            form = urllib.parse.urlencode(dict(username=self.name, password=self.password,
                                               _xsrf=xsrf.group(1) if xsrf else "")).encode()
            begun = time.monotonic()
            with self.http.open(f"{self.url}/hub/login", data=form, timeout=120) as answer:
                where, page = answer.geturl().removeprefix(self.url), answer.read().decode("utf-8", "replace")
            self._to_lab(where, page, begun, start_timeout)
        except (OSError, RuntimeError, ValueError) as exc:
            self.lab.failed = self.lab.failed or f"{type(exc).__name__}: {exc}"

    def start_again(self, start_timeout: float) -> None:
        """What the "Server not running" page's Launch Server button does (GET /hub/spawn/NAME), then as after the
        login; the first lab's record stays in self.first."""
        self.lab = Lab(self.name)
        try:
            begun = time.monotonic()
            where, page = self.get(f"/hub/spawn/{self.name}", timeout=120)
            self._to_lab(where, page, begun, start_timeout)
        except (OSError, RuntimeError, ValueError) as exc:
            self.lab.failed = self.lab.failed or f"{type(exc).__name__}: {exc}"

    def _to_lab(self, where: str, page: str, begun: float, start_timeout: float) -> None:
        if "/spawn-pending/" in where:
            stream = re.search(r'new EventSource\("([^"]+)"\)', page)
            if not stream:
                raise RuntimeError(f"the spawn page at {where} has no progress stream")
            self._follow(html.unescape(stream.group(1)), begun, start_timeout)
        elif f"/user/{self.name}/" not in where:
            raise RuntimeError(f"the hub answered {where}, not a spawn page or a lab")
        if not self.lab.failed:  # the lab's page, through the proxy and the hub's OAuth, as the browser goes on
            where, page = self.get(f"/user/{self.name}/lab", timeout=120)
            if not where.startswith(f"/user/{self.name}/lab") or "jupyter-config-data" not in page:
                raise RuntimeError(f"the lab's page did not come: the hub answered {where}")
            self.lab.seconds = round(time.monotonic() - begun, 1)

    def token(self) -> str:
        """A token of the attendee's own, from the hub's API with their password (what the Token page gives)."""
        request = urllib.request.Request(
            f"{self.url}/hub/api/users/{self.name}/tokens", method="POST", headers={"Content-Type": "application/json"},
            data=json.dumps({"auth": {"username": self.name, "password": self.password}, "expires_in": 3600,
                             "note": "hub-rehearsal"}).encode())
        with urllib.request.urlopen(request, timeout=60) as answer:
            return json.load(answer)["token"]

    def server(self, token: str) -> dict:
        """The hub's view of the attendee's lab (its API's server model); {} when the hub has no lab of theirs."""
        request = urllib.request.Request(f"{self.url}/hub/api/users/{self.name}",
                                         headers={"Authorization": f"token {token}"})
        with urllib.request.urlopen(request, timeout=60) as answer:
            return json.load(answer).get("servers", {}).get("", {})

    def page_without_lab(self) -> tuple[int, str, str]:
        """What the attendee's browser shows at their lab's URL once the hub knows the lab is gone: (status, path,
        the page's words), JupyterHub's 424 "Server not running" page at /hub/user/NAME/lab."""
        try:
            where, page, status = *self.get(f"/user/{self.name}/lab", timeout=60), 200
        except urllib.error.HTTPError as exc:
            where, page, status = exc.url.removeprefix(self.url), exc.read().decode("utf-8", "replace"), exc.code
        said = re.search(r"<h1>(.*?)<a id=\"start\"", page, re.S)  # the heading and messages, up to the button
        words = " ".join(html.unescape(re.sub(r"<[^>]+>", " ", said.group(1) if said else page[:500])).split())
        return status, where.split("?")[0], words

    def _follow(self, stream: str, begun: float, timeout: float) -> None:
        with self.http.open(self.url + stream, timeout=timeout) as events:
            for raw in events:
                line = raw.decode("utf-8", "replace").strip()
                if not line.startswith("data:"):
                    continue
                event = json.loads(line[5:])
                message = event.get("message", "")
                self.lab.messages.append([round(time.monotonic() - begun, 1), message])
                if "PENDING" in message and not self.lab.queued:
                    self.lab.queued, queued_at = message, self.lab.messages[-1][0]
                if " is running on " in message and self.lab.queued and self.lab.queue_s is None:
                    self.lab.queue_s, running_at = round(self.lab.messages[-1][0] - queued_at, 1), \
                        self.lab.messages[-1][0]
                elif " is running on " in message and self.lab.queue_s is None:
                    self.lab.queue_s, running_at = 0.0, self.lab.messages[-1][0]
                if event.get("failed"):
                    self.lab.failed = message or "the hub says the spawn failed"
                    return
                if event.get("ready"):
                    if self.lab.queue_s is not None:
                        self.lab.start_s = round(self.lab.messages[-1][0] - running_at, 1)
                    return
        self.lab.failed = self.lab.failed or "the progress stream ended without the lab being ready"


def wait_until(ready, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not ready():
        if time.monotonic() > deadline:
            return False
        time.sleep(1)
    return True


def lose_node(room: list[Attendee], node: str, start_timeout: float) -> dict:
    """A compute node lost while labs run on it (vcluster.nodes.power_off: its cable pulled, every process on it
    killed): Slurm marks it down and ends its jobs as NODE_FAIL (the lab's batch script asks for no requeue); the hub
    notices each of its labs gone at its next poll; each attendee's lab URL then shows the hub's "Server not running"
    page with how the job ended. The node comes back (rebooted: slurmd started again), and each of its attendees
    presses Launch Server and gets a new lab. Labs on the other nodes run on untouched. Returns the record's
    node_lost part; its "failed" says what did not happen, and is "" when everything did."""
    from vcluster import nodes, slurm
    victims = [a for a in room if a.lab.node == node and a.lab.seconds is not None]
    others = [a for a in room if a not in victims and a.lab.seconds is not None]
    tokens = {a.name: a.token() for a in room}
    record = dict(node=node, labs=[a.name for a in victims], failed="")
    if not victims:
        record["failed"] = f"no lab ran on {node} to lose"
        return record
    # From here on a failure returns at once and leaves the node down: the rehearsal ends with it, and removing the
    # cluster removes the node.
    cut = time.monotonic()
    record["processes_killed"] = len(nodes.power_off(node))
    if not wait_until(lambda: slurm.node_state(node).startswith("down"), NOTICE_S):
        record["failed"] = f"Slurm did not mark {node} down within {NOTICE_S} s of the power cut"
        return record
    record["slurm_down_s"] = round(time.monotonic() - cut, 1)
    noticed: dict[str, float] = {}

    def hub_noticed() -> bool:
        for a in victims:
            if a.name not in noticed and not a.server(tokens[a.name]).get("ready"):
                noticed[a.name] = round(time.monotonic() - cut, 1)
        return len(noticed) == len(victims)
    if not wait_until(hub_noticed, NOTICE_S):
        queue = rehearsal.jobs()
        still = [f"{a.name} (job {a.lab.job}: {queue.get(a.lab.job, 'not in the queue')})" for a in victims
                 if a.name not in noticed]
        record["failed"] = (f"the hub did not notice within {NOTICE_S} s of the power cut that these labs were lost "
                            f"with {node}: {', '.join(still)}")
        return record
    record["hub_noticed_s"] = dict(_spread(list(noticed.values())), each=noticed)
    pages = {a.name: a.page_without_lab() for a in victims}
    record["page"] = pages[victims[0].name]
    wrong = {name: seen for name, seen in pages.items()
             if seen[:2] != (424, f"/hub/user/{name}/lab") or "Server not running" not in seen[2]
             or f"ended: NODE_FAIL on {node}" not in seen[2]}
    if wrong:
        record["failed"] = f"the lab's page did not say that the job ended with its node: {wrong}"
        return record
    kept = [a.name for a in others if a.server(tokens[a.name]).get("ready")]
    record["others_running"] = f"{len(kept)} of {len(others)}"
    if len(kept) < len(others):
        record["failed"] = f"labs on other nodes were lost too: {sorted({a.name for a in others} - set(kept))}"
        return record
    nodes.power_on(node)
    slurm.start_node(node)
    record["node_back_s"] = round(time.monotonic() - cut, 1)
    threads = [threading.Thread(target=a.start_again, args=(start_timeout,), daemon=True) for a in victims]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(start_timeout + 60)
    queue = rehearsal.jobs()
    for a in victims:
        a.lab.job, a.lab.node = next(((job, facts.split()[2]) for job, facts in queue.items()
                                      if facts.split()[:2] == ["RUNNING", a.name] and len(facts.split()) == 3),
                                     ("", ""))
    record["again"] = [asdict(a.lab) for a in victims]
    record["again_seconds"] = _spread([a.lab.seconds for a in victims])
    lost = {a.name: a.lab.failed or "no running job" for a in victims if a.lab.seconds is None or not a.lab.job}
    if lost:
        record["failed"] = f"no new lab after the node came back: {lost}"
    return record


def rehearse(n: int, nodes_n: int, gpus: int, cpus: int, folder: Path, lose: bool = True,
             config: Path = rehearsal.CONFIG) -> dict:
    """The room's first minute; returns the record that main prints and appends to results/."""
    import pwd

    from vcluster import cluster, nodes, slurm
    from tutorial.launch import child_processes

    slurm.install(slurm.PACKAGES)
    names = [f"hubload{i:02d}" for i in range(1, n + 1)]
    # The day's site: one GPU and one core per attendee, these attendees only, a long idle time (no lab is culled
    # during the rehearsal), the hub's state in folder.
    site = rehearsal.site_file(folder, gpus="1", cpus="1", time_limit='"00:30:00"', idle_seconds="3600",
                               start_timeout="600", state_dir=json.dumps(str(folder / "hub-state")),
                               allowed_users=json.dumps(names))
    tag = child_processes.new_tag()
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), **{child_processes.TAG_VARIABLE: tag})
    venv = Path(sys.prefix)
    started = time.monotonic()
    with cluster.cluster(nodes_n, with_slurm=True, gpus=gpus, cpus=cpus), \
            rehearsal.attendees(names) as passwords, rehearsal.reachable_by_attendees(ROOT, venv):
        uids = {name: pwd.getpwnam(name).pw_uid for name in names}
        # A job from before the workshop (a benchmark that overran) holds the last node's GPUs for BLOCKER_S s.
        blocker = nodes.run(rehearsal.LOGIN, ["sbatch", "--parsable", f"--nodelist=node{nodes_n}",
                                               f"--gres=gpu:{gpus}", "--output=/dev/null", "--wrap",
                                               f"sleep {BLOCKER_S}"], timeout=30).stdout.strip()
        with rehearsal.Hub(site, folder / "hub-state", env, config=config) as hub:
            room = [Attendee(hub.url, name, passwords[name]) for name in names]
            threads = [threading.Thread(target=a.start, args=(600,), daemon=True) for a in room]
            logins = time.monotonic()
            for thread in threads:  # everyone within the same minute: the whole room in a few seconds
                thread.start()
                time.sleep(0.5)
            for thread in threads:
                thread.join(660)
            running = rehearsal.jobs()
            for a in room:
                mine = [(job, facts.split()) for job, facts in running.items() if facts.split()[1:2] == [a.name]]
                if mine:
                    a.lab.job, a.lab.node = mine[0][0], (mine[0][1] + ["", "", ""])[2]
            print(f"hub-rehearsal: {n} attendees logged in within {n * 0.5:.0f} s; {time.monotonic() - logins:.0f} s "
                  f"later every one had a lab or an answer; jobs then: {sorted(set(running.values()))}")
            first = [a.lab for a in room]
            node_lost = {}
            if lose and nodes_n > 1 and all(lab.seconds is not None for lab in first):
                node_lost = lose_node(room, f"node{nodes_n}", 600)  # never node1: the login node (hub, slurmctld)
                print(f"hub-rehearsal: node{nodes_n} lost: {node_lost['failed'] or 'every lab on it started again'}")
            elif lose:
                node_lost = dict(skipped="one node only, the login node" if nodes_n == 1 else "not every lab started")
            # Lost: a lab that never started, and one lost with its node that did not start again.
            again = {a.name for a in room if a.lab is not a.first and a.lab.seconds is not None and a.lab.job}
            lost = [lab.name for lab in first if lab.seconds is None or not lab.job]
            lost += [name for name in node_lost.get("labs", []) if name not in again]
        # Hub.stop() cancelled every lab's job; the attendees' processes end with them.
        gone = wait_until(lambda: not rehearsal.jobs(), 90)
        wait_until(lambda: not any(rehearsal.processes_of(uid) for uid in uids.values()), 60)
        left_procs = {name: p for name, uid in uids.items() if (p := rehearsal.processes_of(uid))}
        left_jobs = {} if gone else rehearsal.jobs()
    left_nodes = sorted(({f"node{i}" for i in range(1, nodes_n + 1)} | {nodes.SWITCH}) & set(nodes.netns_list()))
    left_accounts = [name for name in names if _exists(name)]
    seconds = sorted(lab.seconds for lab in first if lab.seconds is not None)
    return dict(
        attendees=n, nodes=nodes_n, gpus_per_node=gpus, cpus_per_node=cpus, blocker_job=blocker, lose_node=lose,
        blocker_seconds=BLOCKER_S,
        spawn_seconds=dict(_spread(seconds), each=seconds),
        queued=sum((lab.queue_s or 0) > QUEUED_S for lab in first), labs_lost=len(lost), lost=lost,
        queue_seconds=_spread([lab.queue_s for lab in first]), start_seconds=_spread([lab.start_s for lab in first]),
        left=dict(jobs=left_jobs, processes=left_procs, nodes=left_nodes, accounts=left_accounts,
                  hub=child_processes.leftovers(tag)),
        node_lost=node_lost, wall_seconds=round(time.monotonic() - started), labs=[asdict(lab) for lab in first])


def _spread(values: list) -> dict:
    known = sorted(v for v in values if v is not None)
    return dict(median=round(statistics.median(known), 1), worst=known[-1]) if known else dict(median=None, worst=None)


def _exists(name: str) -> bool:
    import pwd
    try:
        pwd.getpwnam(name)
        return True
    except KeyError:
        return False


def report(record: dict) -> str:
    spawn = record["spawn_seconds"]
    lines = [f"hub-rehearsal: {record['attendees']} attendees on {record['nodes']} nodes of "
             f"{record['gpus_per_node']} GPUs, an earlier job holding node{record['nodes']}'s GPUs for "
             f"{record['blocker_seconds']} s",
             f"  labs running: {record['attendees'] - record['labs_lost']} of {record['attendees']}; "
             f"from the login to the lab's page: median {spawn['median']} s, worst {spawn['worst']} s",
             f"  of which the job pending in Slurm's queue: median {record['queue_seconds']['median']} s, worst "
             f"{record['queue_seconds']['worst']} s ({record['queued']} labs waited over {QUEUED_S:.0f} s, "
             f"their page saying so); JupyterLab starting in the job: median {record['start_seconds']['median']} s, "
             f"worst {record['start_seconds']['worst']} s"]
    for lab in record["labs"]:
        said = f"; the page said {lab['queued']!r} for {lab['queue_s']} s" if (lab["queue_s"] or 0) > QUEUED_S else ""
        how = f"{lab['seconds']} s, job {lab['job']} on {lab['node']}" if lab["seconds"] is not None else \
            f"NO LAB: {lab['failed']}"
        lines.append(f"    {lab['name']}: {how}{said}")
    lost = record["node_lost"]
    if lost.get("skipped"):
        lines.append(f"  a node lost: not rehearsed ({lost['skipped']})")
    elif lost:
        lines.append(f"  {lost.get('node')} lost (power cut, {lost.get('processes_killed')} processes killed) with "
                     f"{len(lost.get('labs', []))} labs: Slurm marked it down after {lost.get('slurm_down_s')} s")
        if "hub_noticed_s" in lost:
            lines.append(f"    the hub noticed each lab gone after median {lost['hub_noticed_s']['median']} s, worst "
                         f"{lost['hub_noticed_s']['worst']} s; the lab's URL then: {lost['page'][0]} "
                         f"{lost['page'][1]} {lost['page'][2]!r}")
        if "again_seconds" in lost:
            lines.append(f"    labs on the other nodes still running: {lost['others_running']}; node back after "
                         f"{lost['node_back_s']} s; Launch Server to a new lab: median "
                         f"{lost['again_seconds']['median']} s, worst {lost['again_seconds']['worst']} s")
        lines.append(f"    {'FAILED: ' + lost['failed'] if lost['failed'] else 'every lab on it started again'}")
    left = {k: v for k, v in record["left"].items() if v}
    lines.append(f"  labs lost: {record['labs_lost']}; left afterwards: {left or 'nothing'}; "
                 f"{record['wall_seconds']} s in all")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = _Parser(prog="make hub-rehearsal", description=__doc__.splitlines()[0], allow_abbrev=False)
    args.add_argument("--attendees", type=int, default=12, help="attendees logging in at once (default 12)")
    args.add_argument("--nodes", type=int, default=3, help="virtual compute nodes (default 3; node1 is also the "
                                                            "login node)")
    args.add_argument("--gpus", type=int, default=4, help="GPUs per node, one per lab (default 4)")
    args.add_argument("--cpus", type=int, default=4, help="cores per node as Slurm counts them, one per lab "
                                                           "(default 4, whatever this machine has)")
    args.add_argument("--lose-node", action=argparse.BooleanOptionalAction, default=True,
                      help="once every lab runs, lose the last node and start its labs again (default: yes)")
    args.add_argument("--results", type=Path, default=RESULTS,
                      help=f"the folder of hub_load.jsonl (default {RESULTS.relative_to(ROOT)})")
    ns = args.parse_args(argv)
    for name in ("attendees", "nodes", "gpus", "cpus"):
        if getattr(ns, name) < 1:
            args.error(f"--{name} {getattr(ns, name)} is not allowed: give 1 or more")
    if ns.attendees > ns.nodes * min(ns.gpus, ns.cpus):
        args.error(f"--attendees {ns.attendees} is more than {ns.nodes} nodes x {min(ns.gpus, ns.cpus)} labs each "
                   f"can run at once: the rest would wait for a lab to end, which nobody ends here")
    from vcluster import nodes, slurm
    import tempfile
    try:
        nodes.require_root()
        if not (rehearsal.HERE / "node_modules" / ".bin" / "configurable-http-proxy").exists():
            raise nodes.NodesError("the hub's proxy is not installed: make install (npm ci in tools/hub)")
        with tempfile.TemporaryDirectory(prefix="hub-rehearsal-") as folder:
            record = rehearse(ns.attendees, ns.nodes, ns.gpus, ns.cpus, Path(folder), lose=ns.lose_node)
    except nodes.NodesError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except (rehearsal.HubError, slurm.SetupError, subprocess.SubprocessError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(report(record))
    from tutorial.bench.record import append_result  # the benchmarks' record: hardware, versions, command, date
    setup = ("attendees", "nodes", "gpus_per_node", "cpus_per_node", "blocker_job", "blocker_seconds", "lose_node")
    path = append_result(ns.results, "hub_load", [sys.executable, "-m", "hub.load", *(argv or sys.argv[1:])],
                         {k: record[k] for k in setup}, {k: v for k, v in record.items() if k not in setup})
    print(f"hub-rehearsal: appended to {path}")
    return 0 if record["labs_lost"] == 0 and not any(record["left"].values()) and \
        not record["node_lost"].get("failed") else 1


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
