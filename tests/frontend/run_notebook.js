#!/usr/bin/env node
// Opens a notebook in Jupyter Notebook (classic, 6.x) in headless Chromium and
// uses it as a person would: waits for the kernel, Cell > Run All, waits for
// every cell to finish, File > Save and Checkpoint, takes a screenshot, then
// File > Close and Halt. Prints one JSON object with what the page showed;
// tests/python/test_frontends.py makes the assertions.
//
// usage: node run_notebook.js --url http://127.0.0.1:PORT/ --token T
//          --notebook NAME.ipynb --screenshot OUT.png [--chromium /usr/bin/chromium]
//          [--timeout-ms 180000] [--then-when-file PATH --then-code CODE]
//
// With --then-when-file, once every cell ran the page sits idle until PATH
// exists (the test makes it when the kernel slept, docs/hibernation.md),
// then a new cell with CODE is added and run as a person would; what it
// showed is `thenCell`.
'use strict';

const crypto = require('crypto');
const { chromium } = require('playwright-core');

function parseArgs(argv) {
  const args = { chromium: '/usr/bin/chromium', timeoutMs: 180000 };
  for (let i = 0; i < argv.length; i += 2) {
    const key = argv[i].replace(/^--/, '').replace(/-([a-z])/g, (_, c) => c.toUpperCase());
    args[key] = argv[i + 1];
  }
  for (const required of ['url', 'token', 'notebook', 'screenshot']) {
    if (!args[required]) throw new Error(`missing --${required}`);
  }
  args.timeoutMs = Number(args.timeoutMs);
  return args;
}

// The server's view, through its REST API (the same token the page uses).
async function api(args, path) {
  const res = await fetch(new URL(path, args.url), { headers: { Authorization: `token ${args.token}` } });
  if (!res.ok) throw new Error(`GET ${path}: HTTP ${res.status}`);
  return res.json();
}

async function waitFor(what, predicate, timeoutMs) {
  const deadline = Date.now() + timeoutMs;
  for (;;) {
    const value = await predicate();
    if (value) return value;
    if (Date.now() > deadline) throw new Error(`timed out after ${timeoutMs} ms waiting for ${what}`);
    await new Promise((r) => setTimeout(r, 100));
  }
}

async function clickMenu(page, menu, item) {
  await page.click(`#${menu}`);
  await page.click(`#${item}`);
}

// What the page showed; on failure, printed to stderr as far as it got.
const result = { console: [] };

async function main() {
  const args = parseArgs(process.argv.slice(2));
  const log = (msg) => process.stderr.write(`[run_notebook] ${msg}\n`);

  // Chromium's own sandbox needs user namespaces it may not have as root in
  // CI; --no-sandbox turns off the *browser's* sandbox, not cellblock's.
  const launchArgs = ['--disable-dev-shm-usage', '--disable-gpu'];
  if (process.getuid && process.getuid() === 0) launchArgs.push('--no-sandbox');
  const browser = await chromium.launch({
    executablePath: args.chromium, headless: true, args: launchArgs, timeout: args.timeoutMs,
  });
  try {
    const page = await browser.newPage({ viewport: { width: 1280, height: 1000 } });
    page.setDefaultTimeout(args.timeoutMs);
    page.on('console', (m) => result.console.push(`${m.type()}: ${m.text()}`));
    page.on('pageerror', (e) => result.console.push(`pageerror: ${e.message}`));
    page.on('dialog', (d) => d.accept());

    const url = new URL(`notebooks/${encodeURIComponent(args.notebook)}`, args.url);
    url.searchParams.set('token', args.token);
    log(`open ${url.pathname}`);
    await page.goto(url.href, { waitUntil: 'load' });

    // Ready: the page holds the kernel_info_reply that came back through
    // cellblock, and the kernel indicator shows "idle".
    await page.waitForFunction(() => window.Jupyter && Jupyter.notebook && Jupyter.notebook.kernel &&
      Jupyter.notebook.kernel.info_reply && Jupyter.notebook.kernel.info_reply.status === 'ok' &&
      document.querySelector('#kernel_indicator_icon.kernel_idle_icon') !== null);
    result.kernelName = await page.evaluate(() => Jupyter.notebook.kernel.name);
    result.kernelInfo = await page.evaluate(() => Jupyter.notebook.kernel.info_reply || null);
    log(`kernel ${result.kernelName} idle`);

    const codeCells = await page.locator('.cell.code_cell').count();
    await clickMenu(page, 'celllink', 'run_all_cells');
    // Done when every code cell has a number in its prompt ("In [3]:") and
    // the kernel is idle again; "In [*]:" means queued or running.
    await page.waitForFunction((n) => {
      const prompts = [...document.querySelectorAll('.cell.code_cell .input_prompt')].map((p) => p.textContent);
      return prompts.length === n && prompts.every((p) => /\[\d+\]/.test(p)) &&
        document.querySelector('#kernel_indicator_icon.kernel_idle_icon') !== null;
    }, codeCells);
    log('all cells ran');

    result.cells = await page.evaluate(() => [...document.querySelectorAll('.cell.code_cell')].map((cell) => ({
      prompt: cell.querySelector('.input_prompt').textContent.replace(/\s+/g, ' ').trim(),
      stdout: [...cell.querySelectorAll('.output_stdout pre')].map((e) => e.textContent).join(''),
      errors: [...cell.querySelectorAll('.output_error pre')].map((e) => e.textContent),
      images: [...cell.querySelectorAll('.output_png img')].map((img) => ({
        src: img.src,
        complete: img.complete,
        naturalWidth: img.naturalWidth,
        naturalHeight: img.naturalHeight,
        width: img.getBoundingClientRect().width,
        height: img.getBoundingClientRect().height,
      })),
    })));
    // Report the image by prefix, length and the SHA-256 of its decoded bytes
    // (the test compares it with the PNG the notebook saved), not whole.
    for (const cell of result.cells) {
      for (const image of cell.images) {
        const comma = image.src.indexOf(',');
        image.srcPrefix = image.src.slice(0, comma + 1);
        image.srcLength = image.src.length;
        image.sha256 = crypto.createHash('sha256')
          .update(Buffer.from(image.src.slice(comma + 1), 'base64')).digest('hex');
        delete image.src;
      }
    }

    if (args.thenWhenFile) {
      const fs = require('fs');
      log(`waiting for ${args.thenWhenFile}`);
      await waitFor(args.thenWhenFile, async () => fs.existsSync(args.thenWhenFile), args.timeoutMs);
      const count = await page.locator('.cell.code_cell').count();
      await page.evaluate((code) => {
        const cell = Jupyter.notebook.insert_cell_at_bottom('code');
        cell.set_text(code);
        Jupyter.notebook.select(Jupyter.notebook.ncells() - 1);
        Jupyter.notebook.execute_cell();
      }, args.thenCode);
      await page.waitForFunction((n) => {
        const prompts = [...document.querySelectorAll('.cell.code_cell .input_prompt')].map((p) => p.textContent);
        return prompts.length === n && /\[\d+\]/.test(prompts[n - 1]) &&
          document.querySelector('#kernel_indicator_icon.kernel_idle_icon') !== null;
      }, count + 1);
      result.thenCell = await page.evaluate(() => {
        const cells = document.querySelectorAll('.cell.code_cell');
        const cell = cells[cells.length - 1];
        return {
          prompt: cell.querySelector('.input_prompt').textContent.replace(/\s+/g, ' ').trim(),
          stdout: [...cell.querySelectorAll('.output_stdout pre')].map((e) => e.textContent).join(''),
          errors: [...cell.querySelectorAll('.output_error pre')].map((e) => e.textContent),
        };
      });
      result.kernelStatusAfterThen = await page.evaluate(() =>
        document.querySelector('#kernel_indicator_icon').className);
      log(`then-cell ran: ${result.thenCell.prompt}`);
    }

    // Scroll the plot into view and keep what the person would see.
    const img = page.locator('.output_png img').first();
    if (await img.count()) await img.scrollIntoViewIfNeeded();
    await page.screenshot({ path: args.screenshot, fullPage: true });
    log(`screenshot ${args.screenshot}`);

    await clickMenu(page, 'filelink', 'save_checkpoint');
    await page.waitForFunction(() => Jupyter.notebook.dirty === false);
    result.saved = true;

    const sessions = await api(args, 'api/sessions');
    result.sessionsBefore = sessions.map((s) => ({ path: s.path, kernel: s.kernel.name, id: s.kernel.id }));

    // Close and Halt deletes the session on the server, which shuts the kernel down.
    log('close and halt');
    await clickMenu(page, 'filelink', 'close_and_halt');
    await waitFor('the server to have no kernels', async () => (await api(args, 'api/kernels')).length === 0,
      args.timeoutMs);
    result.kernelsAfter = await api(args, 'api/kernels');
    result.sessionsAfter = await api(args, 'api/sessions');
  } finally {
    await browser.close();
  }
  process.stdout.write(JSON.stringify(result, null, 1) + '\n');
}

main().catch((err) => {
  process.stderr.write(`[run_notebook] ${err.stack || err}\n`);
  process.stderr.write(`[run_notebook] page so far: ${JSON.stringify(result, null, 1)}\n`);
  process.exit(1);
});
