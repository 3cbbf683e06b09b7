"""The agent that runs inside every sandbox (docs/agent-protocol.md).

Standard library only: the sandbox's system Python runs it. The worker deploys these modules
flat into one directory (``sandgate.worker.main.install_agent``), bind-mounted read-only at
/opt/sandgate, with main.py under the name sandgate_agent.py and a launcher agent.py beside it;
so the modules import one another by these flat names (and, for type checking only, as
``sandgate.agent.*``). This package file itself is not deployed.
"""

# Every module of the agent, in the order main.py needs them; a unit test checks that this
# is every .py file here and that no name shadows a standard library module.
MODULES = (
    "main",  # the frame loop and dispatch
    "frames",  # the wire format (shared with the control plane)
    "request",  # Header, AgentError, request field readers
    "log",  # one line on stderr per event
    "threads",  # the reused threads requests run on
    "state",  # AgentState: everything the agent keeps in memory; open file handles
    "entries",  # entries, OS errors' codes, upload temp names (shared with the worker)
    "paths",  # sandbox paths onto the real filesystem, OS errors
    "files",  # file operations and open handles
    "execute",  # exec
    "warm",  # exec: the shell started ahead of the next command
    "pressure",  # exec: whether the host's CPUs are saturated (no shell started ahead then)
    "pump",  # the one output pump of exec and background processes
    "orphans",  # the spawn guard; a pid 1's reaper of orphaned zombies
    "procs",  # background processes and terminals: the requests
    "children",  # background processes and terminals: one child, forking a terminal
    "output",  # background processes and terminals: the bounded output buffer
    "watch",  # directory watches (inotify): the requests, the watchers, their event buffers
    "ports",  # connections to the sandbox's ports (previews): one loop thread serves them
)

# Programs deployed beside the agent but never imported by it: the control plane starts them
# as background processes, run by the sandbox's Python with the packages it has.
PROGRAMS = (
    "kernel_bridge",  # one code context: an IPython kernel over jupyter_client (IPC)
)


def deployed_name(module: str) -> str:
    """The file name a module has in the deployed agent directory."""
    return "sandgate_agent.py" if module == "main" else f"{module}.py"
