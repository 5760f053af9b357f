"""Checked by mypy (tests/test_architecture.py), never run: the parts that plug into the
engine, the front-end core and a session satisfy the interfaces those declare."""

from damacy_runtime.core import Engine
from damacy_server.cpu.executor import CpuExecutor
from damacy_server.cuda.executor import CudaExecutor
from damacy_server.daemon.host import SessionHost
from damacy_server.daemon.service import Daemon
from damacy_server.engine.batches import BatchEngine, Executor, Planner
from damacy_server.plan.planner import Planner as ChunkPlanner


def cpu(executor: CpuExecutor) -> Executor:
    return executor


def gpu(executor: CudaExecutor) -> Executor:
    return executor


def planner(p: ChunkPlanner) -> Planner:
    return p


def engine(e: BatchEngine) -> Engine:
    return e


def host(daemon: Daemon) -> SessionHost:
    return daemon
