"""The E2B-compatible surface: E2B's SDKs, unmodified, against sandgate (docs/e2b.md).

A second front-end over the same services as the native API, not a second path:

* `rest`: E2B's control API (`/v2/sandboxes`...) over the create pipeline and lifecycle;
* `volumes`: E2B's volumes (`/volumes`, `volumeMounts`) as the tenant's workspaces;
* `process`, `filesystem`: envd's Connect services over `control.toolbox`;
* `files`: envd's `/files` upload and download, and `/health`;
* `envd`: authentication of envd requests and the routing between these;
* `dispatch`: the one ASGI app of the port, sending each request to E2B's REST API, to
  envd (by the `E2b-Sandbox-Id` header, or a `{port}-{id}.<domain>` Host) or to the native API.

Every call into a sandbox goes through the toolbox, so a sandbox whose worker is attached to
another instance is served through that instance, as for the native API.
"""
