// E2B's code interpreter JavaScript SDK (npm `@e2b/code-interpreter`, pinned in package.json),
// unmodified, against sandgate: run by tests/integration/api/test_e2b_js_code_interpreter.py
// against a real server and worker. `runCode` and the context calls go to port 49999 of the
// sandbox (src/sandgate/api/e2b/interpreter.py), over the sandbox's code contexts.
//
// Only the SDK's documented connection options point it here: apiKey (a sandgate tenant key),
// apiUrl and sandboxUrl (both the server's URL, plain HTTP). Prints one JSON line with what it
// saw and exits 0, or prints the failure and exits 1.
import assert from 'node:assert/strict'

import { Sandbox } from '@e2b/code-interpreter'

const url = process.env.SANDGATE_URL
const apiKey = process.env.SANDGATE_KEY
if (!url || !apiKey) {
  console.error('set SANDGATE_URL (the server) and SANDGATE_KEY (a tenant key)')
  process.exit(2)
}
const opts = { apiKey, apiUrl: url, sandboxUrl: url, requestTimeoutMs: 60_000 }
const results = {}

async function state(sbx) {
  const set = await sbx.runCode('x = 1')
  assert.equal(set.error, undefined, `x = 1 failed: ${JSON.stringify(set.error)}`)
  const read = await sbx.runCode('x + 1')
  assert.equal(read.error, undefined, `x + 1 failed: ${JSON.stringify(read.error)}`)
  assert.equal(read.text, '2')
  assert.ok(read.executionCount > set.executionCount, `${set.executionCount} ${read.executionCount}`)
  const envs = await sbx.runCode("import os; os.environ['ONLY_HERE']", {
    envs: { ONLY_HERE: 'yes' },
  })
  assert.equal(envs.text, "'yes'")
  const frame = await sbx.runCode("import pandas as pd\npd.DataFrame({'a': [1, 2]})")
  assert.ok(frame.results[0]?.html?.includes('<table'), JSON.stringify(frame.results))
  results.state = read.text
}

async function logs(sbx) {
  const seenOut = []
  const seenErr = []
  const logged = await sbx.runCode(
    "import sys\nprint('to out')\nprint('to err', file=sys.stderr)",
    { onStdout: (m) => seenOut.push(m.line), onStderr: (m) => seenErr.push(m.line) },
  )
  assert.deepEqual(logged.logs, { stdout: ['to out\n'], stderr: ['to err\n'] })
  assert.deepEqual([seenOut, seenErr], [['to out\n'], ['to err\n']])
  results.logs = logged.logs
}

async function errors(sbx) {
  const seen = []
  const failed = await sbx.runCode('1 / 0', { onError: (e) => seen.push(e.name) })
  assert.ok(failed.error, 'no error for 1 / 0')
  assert.equal(failed.error.name, 'ZeroDivisionError')
  assert.ok(failed.error.traceback.includes('ZeroDivisionError'), failed.error.traceback)
  assert.deepEqual(seen, ['ZeroDivisionError'])
  results.executionError = failed.error.name
}

async function plot(sbx) {
  const plotted = await sbx.runCode(
    'import matplotlib.pyplot as plt\nplt.plot([1, 4, 9])\nplt.show()',
  )
  assert.equal(plotted.error, undefined, `the plot failed: ${JSON.stringify(plotted.error)}`)
  assert.equal(plotted.results.length, 1, JSON.stringify(plotted.results.map((r) => r.formats())))
  const [figure] = plotted.results
  assert.ok(figure.formats().includes('png'), figure.formats().join(','))
  const png = Buffer.from(figure.png, 'base64')
  assert.ok(png.length > 1000, `a ${png.length}-byte PNG`)
  assert.ok(png.subarray(0, 8).equals(Buffer.from([137, 80, 78, 71, 13, 10, 26, 10])), 'not a PNG')
  results.png = true
}

async function contexts(sbx) {
  await sbx.runCode('secret = 42')
  const other = await sbx.createCodeContext()
  assert.ok(other.id, JSON.stringify(other))
  assert.equal(other.language, 'python')
  const isolated = await sbx.runCode('secret', { context: other })
  assert.ok(isolated.error, 'the second context saw the first one\'s variable')
  assert.equal(isolated.error.name, 'NameError')
  assert.equal((await sbx.runCode('secret')).text, '42')
  const ids = (await sbx.listCodeContexts()).map((c) => c.id)
  assert.ok(ids.includes(other.id), JSON.stringify(ids))
  await sbx.runCode('mine = 1', { context: other })
  await sbx.restartCodeContext(other)
  const restarted = await sbx.runCode('mine', { context: other })
  assert.equal(restarted.error?.name, 'NameError', 'a restart kept the variables')
  await sbx.removeCodeContext(other)
  // removal ends the context's kernel process, which then leaves the listing (not at once:
  // tests/integration/api/test_code_contexts.py waits the same way)
  let left
  for (let i = 0; i < 100; i++) {
    left = (await sbx.listCodeContexts()).map((c) => c.id)
    if (!left.includes(other.id)) break
    await new Promise((resolve) => setTimeout(resolve, 50))
  }
  assert.ok(!left.includes(other.id), `a removed context is still listed: ${JSON.stringify(left)}`)
  results.removedAfter = left
  results.contexts = { isolated: isolated.error.name, removed: true }
}

async function main() {
  const sbx = await Sandbox.create({ ...opts, metadata: { suite: 'e2b-js-code-interpreter' } })
  results.sandboxId = sbx.sandboxId
  try {
    await state(sbx)
    await logs(sbx)
    await errors(sbx)
    await plot(sbx)
    await contexts(sbx)
  } finally {
    results.killed = await sbx.kill()
  }
  assert.equal(results.killed, true)
  assert.equal(await sbx.isRunning(), false)
}

try {
  await main()
  console.log(JSON.stringify({ ok: true, ...results }))
} catch (err) {
  console.log(JSON.stringify({ ...results, ok: false, error: String(err?.stack ?? err) }))
  process.exit(1)
}
