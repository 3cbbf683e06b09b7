// E2B's official JavaScript SDK (npm `e2b`, pinned in package.json), unmodified, against
// sandgate: run by tests/integration/api/test_e2b_js_sdk.py against a real server and worker.
//
// Only the SDK's documented connection options point it here: apiKey (a sandgate tenant key),
// apiUrl and sandboxUrl (both the server's URL, plain HTTP). Prints one JSON line with what it
// saw and exits 0, or prints the failure and exits 1.
import assert from 'node:assert/strict'
import { randomBytes, randomUUID } from 'node:crypto'

import { CommandExitError, Sandbox } from 'e2b'

const url = process.env.SANDGATE_URL
const apiKey = process.env.SANDGATE_KEY
if (!url || !apiKey) {
  console.error('set SANDGATE_URL (the server) and SANDGATE_KEY (a tenant key)')
  process.exit(2)
}
const opts = { apiKey, apiUrl: url, sandboxUrl: url, requestTimeoutMs: 60_000 }
const results = {}

async function commands(sbx) {
  const ran = await sbx.commands.run('echo hi; echo oops >&2')
  assert.deepEqual([ran.stdout, ran.stderr, ran.exitCode], ['hi\n', 'oops\n', 0])
  await assert.rejects(sbx.commands.run('echo partial; exit 3'), (err) => {
    assert.ok(err instanceof CommandExitError, `expected CommandExitError, got ${err}`)
    assert.equal(err.exitCode, 3)
    assert.equal(err.stdout, 'partial\n')
    return true
  })
  const envs = await sbx.commands.run('echo $GREETING-$SANDBOX_WIDE', {
    envs: { GREETING: 'hello' },
  })
  assert.equal(envs.stdout, 'hello-yes\n')
  results.commands = { stdout: ran.stdout, exitCode: ran.exitCode, envs: envs.stdout }
}

async function background(sbx) {
  const seen = []
  const handle = await sbx.commands.run('for i in 1 2 3; do echo tick $i; sleep 0.3; done', {
    background: true,
    onStdout: (data) => seen.push(data),
  })
  assert.ok(handle.pid > 0)
  const done = await handle.wait()
  assert.equal(done.exitCode, 0)
  assert.equal(seen.join(''), 'tick 1\ntick 2\ntick 3\n')
  results.background = seen.join('')
}

async function files(sbx) {
  const info = await sbx.files.write('/home/user/notes/a.txt', 'hello files')
  assert.equal(info.path, '/workspace/notes/a.txt')
  assert.equal(await sbx.files.read('/home/user/notes/a.txt'), 'hello files')
  const blob = new Uint8Array(randomBytes(1 << 20))
  await sbx.files.write('/home/user/notes/big.bin', blob)
  const back = await sbx.files.read('/home/user/notes/big.bin', { format: 'bytes' })
  assert.ok(back instanceof Uint8Array)
  assert.equal(back.length, blob.length)
  assert.ok(Buffer.from(back).equals(Buffer.from(blob)), 'the binary file came back different')
  const listed = Object.fromEntries(
    (await sbx.files.list('/home/user/notes')).map((e) => [e.name, e]),
  )
  assert.deepEqual(Object.keys(listed).sort(), ['a.txt', 'big.bin'])
  assert.equal(listed['a.txt'].size, 11)
  assert.equal(listed['big.bin'].size, blob.length)
  assert.equal(listed['a.txt'].type, 'file')
  results.files = { listed: Object.keys(listed).sort(), bytes: back.length }
}

async function pty(sbx) {
  let out = ''
  let seen
  const marked = new Promise((resolve) => {
    seen = resolve
  })
  const decoder = new TextDecoder()
  const terminal = await sbx.pty.create({
    cols: 80,
    rows: 24,
    onData: (data) => {
      out += decoder.decode(data, { stream: true })
      if (out.includes('mark-42')) seen()
    },
  })
  await sbx.pty.sendInput(terminal.pid, new TextEncoder().encode('stty size; echo mark-$((6*7))\n'))
  let timer
  const timeout = new Promise((_, reject) => {
    timer = setTimeout(() => reject(new Error(`no pty output in time: ${JSON.stringify(out)}`)), 15_000)
  })
  await Promise.race([marked, timeout]).finally(() => clearTimeout(timer))
  assert.ok(out.includes('24 80'), out)
  assert.equal(await sbx.pty.kill(terminal.pid), true)
  results.pty = true
}

async function listing() {
  const tag = randomUUID().slice(0, 8)
  const made = []
  try {
    for (const n of ['0', '1']) made.push(await Sandbox.create({ ...opts, metadata: { suite: tag, n } }))
    const all = []
    const paginator = Sandbox.list({ ...opts, query: { metadata: { suite: tag } } })
    while (paginator.hasNext) all.push(...(await paginator.nextItems()))
    assert.deepEqual(all.map((s) => s.sandboxId).sort(), made.map((s) => s.sandboxId).sort())
    const one = await Sandbox.list({ ...opts, query: { metadata: { suite: tag, n: '1' } } }).nextItems()
    assert.deepEqual(one.map((s) => s.sandboxId), [made[1].sandboxId])
    assert.deepEqual(one[0].metadata, { suite: tag, n: '1' })
    results.listing = all.length
  } finally {
    for (const sandbox of made) await sandbox.kill()
  }
}

async function main() {
  const sbx = await Sandbox.create({
    ...opts,
    metadata: { suite: 'e2b-js' },
    envs: { SANDBOX_WIDE: 'yes' },
  })
  results.sandboxId = sbx.sandboxId
  try {
    assert.ok(await sbx.isRunning())
    await commands(sbx)
    await background(sbx)
    await files(sbx)
    await pty(sbx)
  } finally {
    results.killed = await sbx.kill()
  }
  assert.equal(results.killed, true)
  assert.equal(await sbx.isRunning(), false)
  await listing()
}

try {
  await main()
  console.log(JSON.stringify({ ok: true, ...results }))
} catch (err) {
  console.log(JSON.stringify({ ok: false, error: String(err?.stack ?? err), ...results }))
  process.exit(1)
}
