"""The sandgate Python SDK: `Sandgate` (blocking) and `AsyncSandgate` (asyncio), on httpx.

```python
from sandgate.client import Sandgate

with Sandgate() as sg:  # $SANDGATE_URL / $SANDGATE_API_KEY, else a local `sandgate up`
    box = sg.sandboxes.create(metadata={"agent": "demo"})
    print(box.run("print(6*7)", language="python").stdout)
    job = box.wait_exec_job(box.submit_exec_job("make test").id)  # run once, in the background
    box.files.write("data.csv", Path("data.csv"))
    box.delete()
```

The reference is docs/client.md.
"""

from sandgate.client._async import AsyncSandbox, AsyncSandboxes, AsyncSandgate
from sandgate.client._async_toolbox import AsyncFiles, AsyncProcess, AsyncProcesses, AsyncTerminal
from sandgate.client._base import DEFAULT_URL, KEY_FILE, Progress, RetryPolicy
from sandgate.client._sync import Sandbox, Sandboxes, Sandgate
from sandgate.client._sync_toolbox import Files, Process, Processes, Terminal
from sandgate.client.errors import (
    APIConnectionError,
    APITimeoutError,
    AuthenticationError,
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
    ExecJob,
    ExecJobState,
    ExecResult,
    FileEntry,
    OutputEvent,
    ProcessInfo,
    PtyToken,
    SandboxInfo,
)

__all__ = (
    "DEFAULT_URL",
    "KEY_FILE",
    "APIConnectionError",
    "APITimeoutError",
    "AsyncFiles",
    "AsyncProcess",
    "AsyncProcesses",
    "AsyncSandbox",
    "AsyncSandboxes",
    "AsyncSandgate",
    "AsyncTerminal",
    "AuthenticationError",
    "ConflictError",
    "ExecJob",
    "ExecJobState",
    "ExecJobTimeoutError",
    "ExecResult",
    "FileEntry",
    "Files",
    "GatewayTimeoutError",
    "InvalidRequestError",
    "NotFoundError",
    "OutputEvent",
    "PayloadTooLargeError",
    "PermissionDeniedError",
    "Process",
    "ProcessInfo",
    "Processes",
    "Progress",
    "PtyToken",
    "RateLimitedError",
    "RetryPolicy",
    "Sandbox",
    "SandboxInfo",
    "Sandboxes",
    "Sandgate",
    "SandgateError",
    "ServerError",
    "Terminal",
    "UnavailableError",
)
