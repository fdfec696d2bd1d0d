"""A multi-node job described once in YAML (`moebal launch CLUSTER.yaml`): its schema and its exact commands.

The cluster file names the nodes (host, address, slots), the c10d rendezvous, the environment, how a command
reaches a node (an ssh-like command template, or a Slurm batch script) and the training run (a config with
overrides). Every node runs torchrun (`python -m torch.distributed.run`), which starts the node's ranks,
joins the others through the rendezvous and restarts failed ranks (`max_restarts`); each rank runs
`moebal train` (with `--auto-resume` when restarts are allowed: a restarted rank continues from the run's
last checkpoint; `moebal launch` itself refuses a run directory that already holds a run unless told to
--resume).

Quoting: a node's command is one shell string (what ssh hands to the remote login shell, or `sh -c` runs),
and every value taken from the file is in it through `shlex.quote`, word by word. The template that carries
it to the node is split into words once and never passed through a local shell, but a word of it may reach a
shell later (`sh -c 'echo {host}; ...'`, or the words ssh joins into the remote line): so {host}, {addr} and
{node} always go in through `shlex.quote` (a plain host name is unchanged by it), {command} is already one
quoted shell string, and a placeholder inside a quoted string of a template word is refused, since no
quoting is right for every kind of quote around it. So no host, path, override or environment value can
change the command's structure, whatever characters it holds. Slurm directives only take values without
whitespace (checked here).

The schema is the same kind as the run config's (`moebal.config`): frozen dataclasses with a docstring per
field, unknown keys named with the closest valid key, every impossible value explained.
"""

from __future__ import annotations

import ipaddress
import math
import os
import re
import shlex
import string
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from moebal.config import apply_override, build_schema, read_yaml
from moebal.errors import ConfigError
from moebal.launch.spawn import JOB_START_ENV

__all__ = [
    "ClusterConfig",
    "NodeCommand",
    "NodeConfig",
    "RendezvousConfig",
    "SlurmConfig",
    "SshConfig",
    "TrainLaunchConfig",
    "load_cluster",
    "node_commands",
    "sbatch_script",
    "submit_argv",
    "train_argv",
    "train_overrides",
]

PLACEHOLDERS = ("host", "addr", "node", "command")
LOG_PREFIX = "[rank${rank}]: "  # torchrun substitutes ${rank} (the global rank) in worker log lines
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")


@dataclass(kw_only=True, frozen=True)
class NodeConfig:
    """One machine of the job."""

    host: str | None = None
    """What the ssh template puts in {host}: an ssh destination (`user@gpu-07`), a network namespace, ...
    Slurm: optional; when every node names one, the job asks for exactly these (--nodelist)."""
    addr: str | None = None
    """Address the other nodes reach this node at (torchrun --local-addr); null: the host's own name (of an ssh
    destination `user@gpu-07`, gpu-07)."""
    slots: int = 1
    """Ranks on this node (torchrun --nproc-per-node): one per GPU, or per group of cores on a CPU node."""
    env: dict[str, str | int | float] = field(default_factory=dict)
    """Environment of this node only, over the cluster's `env` (e.g. its own GLOO_SOCKET_IFNAME)."""


@dataclass(kw_only=True, frozen=True)
class RendezvousConfig:
    """Where the nodes meet (torchrun's c10d rendezvous: a TCP store on one of them)."""

    endpoint: str | None = None
    """HOST:PORT of the store; null: the first node's addr (or host) at `port`."""
    port: int = 29500
    """Port of the store when `endpoint` is null."""
    id: str | None = None
    """Job id every node gives (torchrun --rdzv-id); null: the run directory's name (Slurm: the job id)."""
    join_timeout_s: float = 600.0
    """How long a node waits for the others to join before the job fails."""


@dataclass(kw_only=True, frozen=True)
class SshConfig:
    """How the launcher reaches a node (launcher: ssh)."""

    command: str = "ssh -tt -o BatchMode=yes {host} {command}"
    """Command template, split into words like a shell line but never run by a local shell. {command} is the
    node's whole command as one shell-quoted string; {host}, {addr} and {node} (the node's name in logs) are
    the node's values. -tt gives the remote command a terminal, so that it is hung up (and torchrun stops
    its ranks) when the launcher stops the node. A network namespace: `ip netns exec {host} sh -c {command}`;
    this machine: `sh -c {command}`."""
    stop_grace_s: float = 15.0
    """After a node fails, how long the others get to stop after SIGTERM before SIGKILL."""


@dataclass(kw_only=True, frozen=True)
class SlurmConfig:
    """The batch script (launcher: slurm): one torchrun per node through srun."""

    partition: str | None = None
    """#SBATCH --partition; null: the cluster's default."""
    account: str | None = None
    """#SBATCH --account; null: the user's default."""
    time: str | None = "01:00:00"
    """#SBATCH --time (wall-clock limit); null: the partition's default."""
    gpus_per_node: int | None = None
    """#SBATCH --gpus-per-node; null: none requested."""
    cpus_per_task: int | None = None
    """CPUs of each node's task (its torchrun and all its ranks), given to sbatch and srun; null: Slurm's default
    (one CPU per task on most sites: set it, e.g. to the node's cores)."""
    options: tuple[str, ...] = ()
    """More #SBATCH options, each one word like '--qos=high' or '--exclusive'."""
    script: str | None = None
    """Where the script is written; null: launch.sbatch in the run directory."""
    submit: str = "sbatch"
    """The submission command."""


@dataclass(kw_only=True, frozen=True)
class TrainLaunchConfig:
    """The training run every rank executes (`moebal train CONFIG key=value ...`)."""

    config: str | None = None
    """Training config file or preset name; null: the embedded default run. Relative paths are relative to
    the working directory (`workdir`) and must exist there on every node."""
    overrides: dict[str, Any] = field(default_factory=dict)
    """Config overrides, as dotted keys (`train.steps: 100`) or nested sections (`train: {steps: 100}`)."""
    out: str | None = None
    """Run directory (on storage every node sees); null: train.out_dir/NAME-TIMESTAMP, chosen at launch."""


@dataclass(kw_only=True, frozen=True)
class ClusterConfig:
    """A multi-node job: nodes, rendezvous, environment, launcher and the training run."""

    name: str = "cluster"
    """Job name (Slurm job name, default run-directory name)."""
    launcher: Literal["ssh", "slurm"] = "ssh"
    """Start each node's torchrun through the ssh command template, or write and submit a Slurm batch script."""
    nodes: tuple[NodeConfig, ...] = ()
    """The nodes, in order; global ranks follow the rendezvous' order of the nodes' addresses."""
    rendezvous: RendezvousConfig = field(default_factory=RendezvousConfig)
    """Where the nodes meet."""
    env: dict[str, str | int | float] = field(default_factory=dict)
    """Environment of every rank (e.g. GLOO_SOCKET_IFNAME or NCCL_SOCKET_IFNAME: the interface that
    reaches the other nodes, PYTHONPATH, HF_HOME)."""
    python: str | None = None
    """Python interpreter on the nodes; null: the one running `moebal launch`."""
    workdir: str | None = None
    """Directory the nodes run in; null: the directory `moebal launch` runs in."""
    max_restarts: int = 0
    """Times torchrun restarts a node's failed ranks (all ranks restart, from the last checkpoint)."""
    ssh: SshConfig = field(default_factory=SshConfig)
    """launcher: ssh settings."""
    slurm: SlurmConfig = field(default_factory=SlurmConfig)
    """launcher: slurm settings."""
    train: TrainLaunchConfig = field(default_factory=TrainLaunchConfig)
    """The training run."""

    def __post_init__(self) -> None:
        _check(self)

    @property
    def world_size(self) -> int:
        return sum(n.slots for n in self.nodes)

    def node_name(self, i: int) -> str:
        """The node's name in logs and in its log directory."""
        return self.nodes[i].host or f"node{i}"

    @property
    def endpoint(self) -> str:
        """HOST:PORT of the rendezvous store (Slurm without an explicit endpoint: decided in the script)."""
        if self.rendezvous.endpoint is not None:
            return self.rendezvous.endpoint
        first = self.nodes[0]
        host = first.addr or first.host
        assert host is not None  # _check: ssh nodes always name a host
        if first.addr is None:  # an ssh destination (`user@gpu-07`): the address is the host part
            host = host.rpartition("@")[2]
        return f"{_bracket(host)}:{self.rendezvous.port}"


def load_cluster(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> ClusterConfig:
    """A cluster file plus `a.b=value` overrides, checked."""
    data = read_yaml(path)
    for item in overrides:
        apply_override(data, item)
    return build_schema(ClusterConfig, data, source=str(path))


# --------------------------------------------------------------------------------------------
# validation


def _need(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def _check_word(key: str, value: str, what: str) -> None:
    """A value that becomes one argv word of a local program (ssh, ip ...) or a Slurm directive."""
    _need(value != "" and not any(c.isspace() or ord(c) < 32 for c in value),
          f"'{key}' must be one word without spaces or control characters; got {value!r}")
    _need(not value.startswith("-"), f"'{key}' must not start with '-' (it would read as an option of {what}); "
                                     f"got {value!r}")


def _check_env(key: str, env: dict[str, Any]) -> None:
    for name, value in env.items():
        _need(bool(_ENV_NAME.match(name)), f"'{key}': {name!r} is not an environment variable name "
                                           f"(letters, digits and _, not starting with a digit)")
        _need("\0" not in str(value), f"'{key}.{name}' contains a NUL byte")


def _bracket(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def _check_endpoint(endpoint: str) -> None:
    host, sep, port = endpoint.rpartition(":")
    ok = bool(sep) and bool(host) and port.isdigit() and 0 < int(port) < 65536
    _need(ok, f"'rendezvous.endpoint' must look like HOST:PORT (e.g. 10.0.0.1:29500); got {endpoint!r}")
    _check_word("rendezvous.endpoint", endpoint, "torchrun")


def _check_template(template: str) -> None:
    try:
        words = shlex.split(template)
    except ValueError as e:
        raise ConfigError(f"'ssh.command' is not a valid command line ({e}): {template!r}") from None
    _need(bool(words), "'ssh.command' is empty: give a template such as 'ssh {host} {command}'")
    names = []
    for word in words:
        try:
            fields = list(string.Formatter().parse(word))
        except ValueError as e:
            raise ConfigError(f"'ssh.command': bad placeholder in {word!r} ({e}); write a literal brace as "
                              f"{{{{ or }}}}") from None
        quote = ""  # the shell quote open before each placeholder, were the word read by a shell
        for literal, name, spec, conv in fields:
            quote = _quote_after(literal, quote)
            if name is None:
                continue
            _need(name in PLACEHOLDERS and not spec and not conv,
                  f"'ssh.command': unknown placeholder {{{name}}} in {word!r}; placeholders: "
                  + ", ".join(f"{{{p}}}" for p in PLACEHOLDERS))
            _need(not quote, f"'ssh.command': {{{name}}} is inside a {quote}-quoted string in {word!r}; values are "
                             f"shell-quoted where they go in, so put the placeholder outside the quotes "
                             f"(e.g. echo node={{{name}}})")
            names.append(name)
    _need("command" in names, f"'ssh.command' must contain {{command}} (the node's command), e.g. "
                              f"'ssh -tt {{host}} {{command}}'; got {template!r}")


def _quote_after(text: str, quote: str) -> str:
    """The shell quote (\' or \", or none: "") open after `text`, starting inside `quote`."""
    escaped = False
    for ch in text:
        if escaped:
            escaped = False
        elif ch == "\\" and quote != "'":
            escaped = True
        elif ch in "'\"" and quote in ("", ch):
            quote = "" if quote else ch
    return quote


def _fill(word: str, values: dict[str, str]) -> str:
    """One template word with a node's values: {command} as it is (a quoted shell string already), the
    others through shlex.quote, so that they stay one literal word if a shell ever reads this one."""
    out = []
    for literal, name, _, _ in string.Formatter().parse(word):
        out.append(literal)
        if name is not None:
            out.append(values[name] if name == "command" else shlex.quote(values[name]))
    return "".join(out)


def _check(c: ClusterConfig) -> None:
    _need(len(c.nodes) >= 1, "'nodes' is empty: list the nodes, e.g. nodes: [{host: gpu-01, slots: 8}]")
    _need(c.max_restarts >= 0, f"'max_restarts' must be >= 0; got {c.max_restarts}")
    _check_env("env", c.env)
    for i, n in enumerate(c.nodes):
        _need(n.slots >= 1, f"'nodes[{i}].slots' must be at least 1; got {n.slots}")
        if n.host is not None:
            _check_word(f"nodes[{i}].host", n.host, "the launcher")
        if n.addr is not None:
            _check_word(f"nodes[{i}].addr", n.addr, "torchrun")
        _check_env(f"nodes[{i}].env", n.env)
    r = c.rendezvous
    if r.endpoint is not None:
        _check_endpoint(r.endpoint)
    _need(0 < r.port < 65536, f"'rendezvous.port' must be in 1..65535; got {r.port}")
    _need(math.isfinite(r.join_timeout_s) and r.join_timeout_s > 0,
          f"'rendezvous.join_timeout_s' must be positive; got {r.join_timeout_s}")
    if r.id is not None:
        _check_word("rendezvous.id", r.id, "torchrun")
    _check_train(c.train)
    nproc = flatten_overrides(c.train.overrides).get("parallel.nproc")
    _need(nproc is None or nproc == c.world_size,
          f"'train.overrides': parallel.nproc={nproc} but the cluster file's nodes run {c.world_size} ranks, which "
          f"torchrun gives every rank: drop parallel.nproc (the nodes' slots set it) or change the nodes")
    if c.launcher == "ssh":
        _check_ssh(c)
    else:
        _check_slurm(c)


def _check_train(t: TrainLaunchConfig) -> None:
    for key in flatten_overrides(t.overrides):
        _need(bool(_KEY.match(key)), f"'train.overrides': {key!r} is not a config key (section.key, e.g. "
                                     f"train.steps)")
    _need(t.config != "", "'train.config' is empty: give a config path, a preset name, or null")
    _need(t.out != "", "'train.out' is empty: give a run directory or null")


def _check_ssh(c: ClusterConfig) -> None:
    _check_template(c.ssh.command)
    missing = [i for i, n in enumerate(c.nodes) if n.host is None]
    _need(not missing, f"'nodes[{missing[0] if missing else 0}].host' is missing: the ssh launcher needs every "
                       f"node's host")
    names = [c.node_name(i) for i in range(len(c.nodes))]
    dup = sorted({x for x in names if names.count(x) > 1})
    _need(not dup, f"'nodes': host {dup[0] if dup else ''!r} is listed twice; give each node once with its "
                   f"slots")
    # what each node's ranks publish: one machine each (a loopback address may repeat: nodes of one machine, a
    # local test of the launcher)
    addrs = [n.addr for n in c.nodes if n.addr and not _loopback(n.addr)]
    dup = sorted({x for x in addrs if addrs.count(x) > 1})
    _need(not dup, f"'nodes': addr {dup[0] if dup else ''!r} is given to two nodes; each node's addr is the "
                   f"address of its own machine")
    _need(c.ssh.stop_grace_s >= 0, f"'ssh.stop_grace_s' must be >= 0; got {c.ssh.stop_grace_s}")


def _loopback(addr: str) -> bool:
    try:
        return addr == "localhost" or ipaddress.ip_address(addr.strip("[]")).is_loopback
    except ValueError:
        return False


def _check_slurm(c: ClusterConfig) -> None:
    s = c.slurm
    slots = {n.slots for n in c.nodes}
    _need(len(slots) == 1, f"'nodes': Slurm starts the same command on every node, so every node needs the "
                           f"same slots; got {sorted(slots)}")
    hosts = [n.host for n in c.nodes]
    _need(all(h is None for h in hosts) or all(h is not None for h in hosts),
          "'nodes': name the host of every node (Slurm --nodelist) or of none (Slurm chooses)")
    for i, n in enumerate(c.nodes):
        _need(n.addr is None and not n.env, f"'nodes[{i}]': addr and env per node are for the ssh launcher; "
                                             f"under Slurm use the cluster's env (and rendezvous.endpoint)")
    for key, value in (("slurm.partition", s.partition), ("slurm.account", s.account), ("slurm.time", s.time)):
        if value is not None:
            _check_word(key, value, "sbatch")
    for i, opt in enumerate(s.options):
        _need(opt.startswith("--") and not any(ch.isspace() or ord(ch) < 32 for ch in opt),
              f"'slurm.options[{i}]' must be one option word such as '--qos=high'; got {opt!r}")
    for key, v in (("slurm.gpus_per_node", s.gpus_per_node), ("slurm.cpus_per_task", s.cpus_per_task)):
        _need(v is None or v >= 1, f"'{key}' must be at least 1 or null; got {v}")
    _need(bool(s.submit.strip()), "'slurm.submit' is empty: give the submission command (sbatch)")


# --------------------------------------------------------------------------------------------
# the training command


def flatten_overrides(overrides: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested sections and dotted keys as one flat {dotted.key: value} mapping."""
    flat: dict[str, Any] = {}
    for key, value in overrides.items():
        full = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flatten_overrides(value, full + "."))
        else:
            flat[full] = value
    return flat


def _yaml_scalar(value: Any) -> str:
    """The YAML text that reads back as `value` (so `off` stays the string 'off', 1e-3 stays a number)."""
    text: str = yaml.safe_dump(value, default_flow_style=True, width=math.inf)
    return text.removesuffix("\n").removesuffix("\n...").strip()


def train_overrides(t: TrainLaunchConfig) -> list[str]:
    """The overrides as `key=value` arguments of `moebal train`."""
    return [f"{k}={_yaml_scalar(v)}" for k, v in flatten_overrides(t.overrides).items()]


def train_argv(c: ClusterConfig, out: str, resume: bool = False) -> list[str]:
    """`moebal.cli` arguments every rank runs."""
    argv = ["train"]
    if c.train.config is not None:
        argv.append(c.train.config)
    argv += train_overrides(c.train)
    argv += ["--out", out]
    if resume:
        argv.append("--resume")
    elif c.max_restarts:
        # a rank restarted by torchrun continues from the newest complete checkpoint (its own
        # TORCHELASTIC_RESTART_COUNT cannot tell it: a node restarted for another node's failure keeps its count)
        argv.append("--auto-resume")
    return argv


# --------------------------------------------------------------------------------------------
# per-node commands (launcher: ssh)


@dataclass(frozen=True)
class NodeCommand:
    """What the launcher runs for one node: `argv` locally (no shell), `remote` is its shell command."""

    index: int
    name: str
    argv: list[str]
    remote: str


def _python(c: ClusterConfig) -> str:
    return c.python or sys.executable


def node_env(c: ClusterConfig, i: int | None) -> dict[str, str]:
    """The environment a node's torchrun starts with: moebal's defaults, the cluster's, the node's."""
    # TORCH_DISABLE_SHARE_RDZV_TCP_STORE: when the ranks share the rendezvous' store, restarted ranks read the
    # previous attempt's process-group keys (stale addresses: "connection refused"; pytorch/pytorch#135712);
    # with it the first rank of each attempt hosts a fresh store.
    env = {"PYTHONUNBUFFERED": "1", "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE": LOG_PREFIX,
           "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    env.update({k: str(v) for k, v in c.env.items()})
    if i is not None:
        env.update({k: str(v) for k, v in c.nodes[i].env.items()})
    return env


def _log_dir(out: str, name: str) -> str:
    return str(Path(out) / "logs" / re.sub(r"[^A-Za-z0-9._-]", "_", name))


def torchrun_argv(c: ClusterConfig, i: int, train: list[str], out: str) -> list[str]:
    """Node i's torchrun: c10d rendezvous, this node's ranks, restarts, per-rank log files and prefixes."""
    node = c.nodes[i]
    conf = [f"join_timeout={int(math.ceil(c.rendezvous.join_timeout_s))}"]
    endpoint_host = c.endpoint.rpartition(":")[0].strip("[]")
    own = [n.addr or (n.host or "").rpartition("@")[2] for n in c.nodes]  # as `endpoint` names them: no user@
    if endpoint_host in own:
        # say which node hosts the store: torch guesses it from the hostname, which fails where several
        # nodes share one (network namespaces, containers) or where the hostname resolves to loopback
        conf.append(f"is_host={int(own[i] == endpoint_host and own.index(endpoint_host) == i)}")
    argv = [_python(c), "-m", "torch.distributed.run", f"--nnodes={len(c.nodes)}",
            f"--nproc-per-node={node.slots}", "--rdzv-backend=c10d", f"--rdzv-endpoint={c.endpoint}",
            f"--rdzv-id={c.rendezvous.id or Path(out).name}", f"--rdzv-conf={','.join(conf)}",
            f"--max-restarts={c.max_restarts}", "--tee=3", f"--log-dir={_log_dir(out, c.node_name(i))}"]
    if node.addr is not None:
        argv.append(f"--local-addr={node.addr}")
    return [*argv, "-m", "moebal.cli", *train]


def remote_command(c: ClusterConfig, i: int, train: list[str], out: str) -> str:
    """Node i's command as one shell string; every word from the cluster file is quoted."""
    words = [*(f"{k}={v}" for k, v in node_env(c, i).items()), *torchrun_argv(c, i, train, out)]
    # the job's start on the node's clock, once for all of torchrun's attempts: train.time_limit_min counts from it
    cmd = f"exec env {JOB_START_ENV}=$(date +%s) {shlex.join(words)}"
    workdir = c.workdir or os.getcwd()
    return f"cd {shlex.quote(workdir)} && {cmd}"


def node_commands(c: ClusterConfig, train: list[str], out: str) -> list[NodeCommand]:
    """One local argv per node: the ssh template with the node's values and command filled in, word by word."""
    words = shlex.split(c.ssh.command)
    cmds = []
    for i, node in enumerate(c.nodes):
        remote = remote_command(c, i, train, out)
        values = {"host": node.host or "", "addr": node.addr or node.host or "", "node": c.node_name(i),
                  "command": remote}
        cmds.append(NodeCommand(i, c.node_name(i), [_fill(w, values) for w in words], remote))
    return cmds


# --------------------------------------------------------------------------------------------
# Slurm


def sbatch_script(c: ClusterConfig, train: list[str], out: str) -> str:
    """The batch script: #SBATCH directives, the environment, then one torchrun per node through srun."""
    s, n = c.slurm, len(c.nodes)
    lines = ["#!/bin/bash", f"# {c.name}: {n} nodes x {c.nodes[0].slots} ranks, written by `moebal launch`",
             f"#SBATCH --job-name={re.sub(r'[^A-Za-z0-9._-]', '_', c.name)}", f"#SBATCH --nodes={n}",
             "#SBATCH --ntasks-per-node=1"]
    if all(node.host for node in c.nodes):
        lines.append(f"#SBATCH --nodelist={','.join(node.host or '' for node in c.nodes)}")
    for opt, value in (("partition", s.partition), ("account", s.account), ("time", s.time),
                       ("gpus-per-node", s.gpus_per_node), ("cpus-per-task", s.cpus_per_task)):
        if value is not None:
            lines.append(f"#SBATCH --{opt}={value}")
    lines += [f"#SBATCH {opt}" for opt in s.options]
    lines += ["set -euo pipefail", f"cd {shlex.quote(c.workdir or os.getcwd())}"]
    lines += [f"export {k}={shlex.quote(v)}" for k, v in node_env(c, None).items()]
    lines.append(f"export {JOB_START_ENV}=$(date +%s)")  # train.time_limit_min counts from the job's start
    if c.rendezvous.endpoint is None:  # the store runs on the job's first node
        # sed, not head: head would leave scontrol writing into a closed pipe, failing the script (pipefail)
        lines.append('head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | sed -n 1p)')
        endpoint = f'"$head_node":{c.rendezvous.port}'
    else:
        endpoint = shlex.quote(c.rendezvous.endpoint)
    rdzv_id = shlex.quote(c.rendezvous.id) if c.rendezvous.id else '"$SLURM_JOB_ID"'
    torchrun = [_python(c), "-m", "torch.distributed.run", f"--nnodes={n}", f"--nproc-per-node={c.nodes[0].slots}",
                "--rdzv-backend=c10d", f"--rdzv-conf=join_timeout={int(math.ceil(c.rendezvous.join_timeout_s))}",
                f"--max-restarts={c.max_restarts}", "--tee=3"]
    log_dir = shlex.quote(str(Path(out) / "logs"))  # torchrun adds a directory of its own per node and run
    # srun: every node's task stops when one fails (--kill-on-bad-exit); --label prefixes lines with the node;
    # --cpus-per-task again, since srun no longer inherits it from sbatch (Slurm 22.05): without it the node's
    # torchrun and all its ranks would share the step's default of one CPU
    srun = "srun --kill-on-bad-exit=1 --label" + (f" --cpus-per-task={s.cpus_per_task}" if s.cpus_per_task else "")
    lines.append(" ".join([srun, shlex.join(torchrun),
                           f"--rdzv-endpoint={endpoint}", f"--rdzv-id={rdzv_id}", f"--log-dir={log_dir}",
                           "-m moebal.cli", shlex.join(train)]))
    return "\n".join(lines) + "\n"


def script_path(c: ClusterConfig, out: str) -> str:
    return c.slurm.script or str(Path(out) / "launch.sbatch")


def submit_argv(c: ClusterConfig, out: str) -> list[str]:
    """The submission command (the output path goes here, not in a directive, so it may hold spaces)."""
    return [*shlex.split(c.slurm.submit), f"--output={Path(out) / 'slurm-%j.out'}", script_path(c, out)]
