"""The sandgate Python SDK: `Sandgate` (blocking) and `AsyncSandgate` (asyncio), on httpx.

```python
from sandgate.client import Sandgate

with Sandgate() as sg:  # $SANDGATE_URL / $SANDGATE_API_KEY, else a local `sandgate up`
    box = sg.sandboxes.create(metadata={"agent": "demo"})
    print(box.run("print(6*7)", language="python").stdout)
    box.run_code("x = 41"); print(box.run_code("x + 1").text)  # a stateful IPython kernel
    job = box.wait_exec_job(box.submit_exec_job("make test").id)  # run once, in the background
    box.files.write("data.csv", Path("data.csv"))
    box.delete()
    ws = sg.workspaces.create("proj")  # files that outlive sandboxes, with a git history
    sg.sandboxes.create(workspace=ws).run("echo hi > notes.txt"); ws.commit("notes")
```

The reference is docs/client.md.
"""

from sandgate.client._async import (
    AsyncSandbox,
    AsyncSandboxes,
    AsyncSandgate,
    AsyncTemplates,
    AsyncWorkspace,
    AsyncWorkspaces,
)
from sandgate.client._async_toolbox import (
    AsyncCodeContexts,
    AsyncFiles,
    AsyncProcess,
    AsyncProcesses,
    AsyncTerminal,
)
from sandgate.client._base import DEFAULT_URL, KEY_FILE, Progress, RetryPolicy
from sandgate.client._sync import Sandbox, Sandboxes, Sandgate, Templates, Workspace, Workspaces
from sandgate.client._sync_toolbox import CodeContexts, Files, Process, Processes, Terminal
from sandgate.client.errors import (
    APIConnectionError,
    APITimeoutError,
    AuthenticationError,
    BuildFailedError,
    ConflictError,
    ExecJobTimeoutError,
    GatewayTimeoutError,
    InvalidRequestError,
    NotFoundError,
    PayloadTooLargeError,
    PermissionDeniedError,
    RateLimitedError,
    SandgateError,
    ServerError,
    UnavailableError,
)
from sandgate.client.models import (
    CodeContext,
    Commit,
    CommitAuthor,
    CommitDiff,
    CommitResult,
    ExecJob,
    ExecJobState,
    ExecResult,
    Execution,
    ExecutionError,
    FileEntry,
    FileStat,
    NetworkState,
    OutputEvent,
    OutputMessage,
    Preview,
    ProcessInfo,
    PtyToken,
    Result,
    SandboxInfo,
    SkippedFile,
    TemplateInfo,
    WorkspaceInfo,
    WorkspaceMount,
)

__all__ = (
    "DEFAULT_URL",
    "KEY_FILE",
    "APIConnectionError",
    "APITimeoutError",
    "AsyncCodeContexts",
    "AsyncFiles",
    "AsyncProcess",
    "AsyncProcesses",
    "AsyncSandbox",
    "AsyncSandboxes",
    "AsyncSandgate",
    "AsyncTemplates",
    "AsyncTerminal",
    "AsyncWorkspace",
    "AsyncWorkspaces",
    "AuthenticationError",
    "BuildFailedError",
    "CodeContext",
    "CodeContexts",
    "Commit",
    "CommitAuthor",
    "CommitDiff",
    "CommitResult",
    "ConflictError",
    "ExecJob",
    "ExecJobState",
    "ExecJobTimeoutError",
    "ExecResult",
    "Execution",
    "ExecutionError",
    "FileEntry",
    "FileStat",
    "Files",
    "GatewayTimeoutError",
    "InvalidRequestError",
    "NetworkState",
    "NotFoundError",
    "OutputEvent",
    "OutputMessage",
    "PayloadTooLargeError",
    "PermissionDeniedError",
    "Preview",
    "Process",
    "ProcessInfo",
    "Processes",
    "Progress",
    "PtyToken",
    "RateLimitedError",
    "Result",
    "RetryPolicy",
    "Sandbox",
    "SandboxInfo",
    "Sandboxes",
    "Sandgate",
    "SandgateError",
    "ServerError",
    "SkippedFile",
    "TemplateInfo",
    "Templates",
    "Terminal",
    "UnavailableError",
    "Workspace",
    "WorkspaceInfo",
    "WorkspaceMount",
    "Workspaces",
)
