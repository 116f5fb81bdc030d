// Drives ComfyUI's real frontend in headless Chromium for tests/comfyui/test_browser.py; prints one JSON object.
//   node browser_check.cjs <server url> <pack folder> <workflow names as JSON> <chromium> <prompts as JSON:
//        {short, long, fallback}> <thumbnail folder> <screenshot path>
// Writes each workflow's template thumbnail (<thumbnail folder>/<name>.jpg: the graph fitted to the view, shrunk) and
// a screenshot of the text-to-image workflow as it opens from the template browser (PNG, the whole window).
// Needs playwright-core on NODE_PATH.
const fs = require("fs");
const path = require("path");
const { chromium } = require("playwright-core");

const [url, pack, names, executablePath, prompts, thumbnails, screenshot] = process.argv.slice(2);
const EXTENSION = "flux2_klein.ui";   // this pack's frontend extension (web/js/flux2_klein.js)
const VIEW = { width: 1600, height: 1000 };
// the minimap would cover a corner of the graph in a thumbnail
const THUMBNAIL = { width: 560, quality: 0.8, style: ".minimap-main-container { visibility: hidden !important; }" };
const THUMBNAIL_MARGIN = 24;   // screen pixels around the graph
const THUMBNAIL_VIEW = { width: 2400, height: 1500 };
const SCREENSHOT_OF = "flux2-klein-text-to-image";

// in the page: open a workflow as the template browser does (a tab named after it), convert it with the frontend's
// own UI -> API conversion, and measure it fitted to the view
async function openWorkflow({ pack, name, margin }) {
  const app = window.app;
  const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));
  const workflow = await (await fetch(`/api/workflow_templates/${pack}/${name}.json`)).json();
  await app.loadGraphData(workflow, true, true, name, { openSource: "template" });
  const prompt = (await app.graphToPrompt()).output;
  // the prompt nodes' token counts as the server gives them (the estimate shows until it answers)
  const encoders = app.graph.nodes.filter((n) => n.type === "Flux2KleinPromptEncode");
  for (const end = Date.now() + 10000; !encoders.every((n) => n.flux2Tokens?.exact) && Date.now() < end;) await sleep(50);
  // the open graph fitted to the view: its zoom, overlapping nodes, links drawn behind a node, group titles
  const layout = async () => {
    app.canvas.fitViewToSelectionAnimated({ duration: 1 });
    await sleep(300);
    const nodes = app.graph.nodes;
    const box = (n) => { const [x, y, w, h] = n.boundingRect; return [x, y, x + w, y + h]; };
    const inside = ([x, y], n) => { const [x0, y0, x1, y1] = box(n); return x > x0 && x < x1 && y > y0 && y < y1; };
    const overlaps = [];
    for (const a of nodes) for (const b of nodes) {
      const [ax0, ay0, ax1, ay1] = box(a), [bx0, by0, bx1, by1] = box(b);
      if (a.id < b.id && ax0 < bx1 && bx0 < ax1 && ay0 < by1 && by0 < ay1) overlaps.push(`${a.title} / ${b.title}`);
    }
    const behind = new Set();
    for (const link of app.graph.links.values()) {   // litegraph's spline: control points 1/4 of the length out
      const from = app.graph.getNodeById(link.origin_id), to = app.graph.getNodeById(link.target_id);
      const a = from.getConnectionPos(false, link.origin_slot), d = to.getConnectionPos(true, link.target_slot);
      const reach = Math.hypot(d[0] - a[0], d[1] - a[1]) * 0.25;
      const b = [a[0] + reach, a[1]], c = [d[0] - reach, d[1]];
      for (let i = 1; i < 50; i++) {
        const t = i / 50, u = 1 - t;
        const at = [0, 1].map((k) => u * u * u * a[k] + 3 * u * u * t * b[k] + 3 * u * t * t * c[k] + t * t * t * d[k]);
        const hidden = nodes.find((n) => n !== from && n !== to && inside(at, n));
        if (hidden) behind.add(`${from.title} -> ${to.title} behind ${hidden.title}`);
      }
    }
    const groupOverlaps = [];     // a group drawn over another one's nodes reads as both
    for (const a of app.graph.groups) for (const b of app.graph.groups) {
      const [ax, ay, aw, ah] = a.boundingRect, [bx, by, bw, bh] = b.boundingRect;
      if (a.id < b.id && ax < bx + bw && bx < ax + aw && ay < by + bh && by < ay + ah) groupOverlaps.push(`${a.title} / ${b.title}`);
    }
    return { scale: app.canvas.ds.scale, overlaps, groupOverlaps, behind: [...behind], groups: app.graph.groups.map((g) => g.title),
             titles: nodes.map((n) => n.title) };
  };
  const measured = await layout();
  // where the graph (nodes and groups) is on the screen, with a margin: the thumbnail's clip
  const items = [...app.graph.nodes, ...app.graph.groups].map((item) => item.boundingRect);
  const [x0, y0] = app.canvas.ds.convertOffsetToCanvas([Math.min(...items.map((r) => r[0])), Math.min(...items.map((r) => r[1]))]);
  const [x1, y1] = app.canvas.ds.convertOffsetToCanvas([Math.max(...items.map((r) => r[0] + r[2])),
                                                          Math.max(...items.map((r) => r[1] + r[3]))]);
  const canvas = app.canvas.canvas.getBoundingClientRect();
  const clip = { x: canvas.left + x0 - margin, y: canvas.top + y0 - margin, width: x1 - x0 + 2 * margin,
                 height: y1 - y0 + 2 * margin };
  // a subgraph node (a compact workflow) shows the widgets promoted from inside it
  measured.promoted = app.graph.nodes.filter((n) => n.isSubgraphNode?.()).map((n) => n.widgets.map((w) => [w.name, w.value]));
  return { prompt, layout: measured, clip,
           colours: app.graph.nodes.filter((n) => n.type?.startsWith("Flux2Klein")).map((n) => [n.color, n.bgcolor]) };
}

// in the page: a PNG screenshot shrunk to `width` pixels, as a JPEG data URL
async function shrink({ png, width, quality }) {
  const image = new Image();
  image.src = `data:image/png;base64,${png}`;
  await image.decode();
  const canvas = document.createElement("canvas");
  canvas.width = width;
  canvas.height = Math.round((image.height * width) / image.width);
  const context = canvas.getContext("2d");
  context.imageSmoothingQuality = "high";
  context.drawImage(image, 0, 0, canvas.width, canvas.height);
  return canvas.toDataURL("image/jpeg", quality);
}

// what the user sees, to a file: the whole window as a PNG, or a clip of it shrunk to a JPEG
async function picture(page, file, { clip, width, quality, style } = {}) {
  const png = await page.screenshot({ clip, style });
  fs.mkdirSync(path.dirname(file), { recursive: true });
  if (!width) return fs.writeFileSync(file, png);
  const jpeg = await page.evaluate(shrink, { png: png.toString("base64"), width, quality });
  fs.writeFileSync(file, Buffer.from(jpeg.split(",")[1], "base64"));
}

// in the page: the template browser's cards for this pack, with the picture each shows
function templateCards() {
  const images = [...document.querySelectorAll("[role=dialog] img[alt]")];
  return Object.fromEntries(images.map((i) => [i.alt, { src: i.src.startsWith("blob:") ? "blob" : i.src,
                                                          width: i.naturalWidth, height: i.naturalHeight }]));
}

async function inPage({ prompts }) {   // runs in the page: it sees only its arguments and window
  const TOKENS_ROUTE = "/flux2_klein/tokens";
  const TOKENS_FEATURE = "flux2_klein_tokens";
  const app = window.app;
  const api = window.comfyAPI.api.api;
  const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));
  const until = async (check, ms) => {
    for (const end = Date.now() + ms; !check() && Date.now() < end;) await sleep(50);
    return check();
  };
  const ours = (node) => node.type?.startsWith("Flux2Klein");
  const result = { registered: Object.keys(LiteGraph.registered_node_types).filter((t) => t.startsWith("Flux2Klein")),
                   colours: [] };

  // a scheduler saved before its width and height became sockets: five widget values, the size ones dropped
  await app.loadGraphData({ last_node_id: 1, last_link_id: 0, links: [], groups: [], config: {}, extra: {}, version: 0.4,
    nodes: [{ id: 1, type: "Flux2KleinScheduler", pos: [0, 0], size: [220, 150], flags: {}, order: 0, mode: 0,
              inputs: [{ name: "latent", type: "LATENT", link: null }],
              outputs: [{ name: "sigmas", type: "SIGMAS", links: [] }], properties: {},
              widgets_values: [7, 768, 512, "power", 3.0] }] });
  result.oldScheduler = app.graph.nodes[0].widgets.map((w) => [w.name, w.value]);

  // a new prompt node: the estimate at once, the server's exact count once typing pauses, the warning past 512
  result.feature = await until(() => api.serverSupportsFeature(TOKENS_FEATURE), 15000);
  const requests = [];
  const fetchApi = api.fetchApi;
  api.fetchApi = function (route, options) {
    if (route === TOKENS_ROUTE) requests.push(JSON.parse(options.body).text);
    return fetchApi.call(this, route, options);
  };
  app.graph.clear();
  const encode = LiteGraph.createNode("Flux2KleinPromptEncode");
  app.graph.add(encode);
  result.colours.push([encode.color, encode.bgcolor]);
  const text = encode.widgets.find((w) => w.name === "prompt");
  const type = (value) => {
    text.value = value;
    text.inputEl?.dispatchEvent(new Event("input"));
    return { ...encode.flux2Tokens };
  };
  const answered = async (value) => {            // the label while typing, and after the server answered
    const typed = type(value);
    await until(() => encode.flux2Tokens?.exact && encode.flux2Tokens.text === value, 30000);
    return { typed, answered: { ...encode.flux2Tokens } };
  };
  await answered("");                             // the node's first request, before the checks below
  requests.length = 0;
  for (let n = 1; n < prompts.short.length; n += 4) type(prompts.short.slice(0, n));   // fast typing ...
  result.short = await answered(prompts.short);   // ... asks once, for the last text
  result.long = await answered(prompts.long);
  result.requests = [...requests];
  // a server without the route: the estimate stays. The feature is asked of api.serverSupportsFeature, whatever
  // each frontend keeps the server's flags in
  const supports = api.serverSupportsFeature;
  api.serverSupportsFeature = (name) => name !== TOKENS_FEATURE && supports.call(api, name);
  result.fallback = type(prompts.fallback);
  await sleep(1000);
  result.fallback = { typed: result.fallback, later: { ...encode.flux2Tokens } };
  api.serverSupportsFeature = supports;
  api.fetchApi = fetchApi;
  // the same prompt from a FLUX 3 text encoder's loader: that encoder's template and limit
  const loader = LiteGraph.createNode("Flux2KleinTextEncoderLoader");
  app.graph.add(loader);
  loader.widgets.find((w) => w.name === "text_encoder_name").value = prompts.flux3_encoder;
  loader.connect(0, encode, 0);
  result.flux3 = await answered(prompts.short);

  // a new noise node: width/height snap to multiples of 16
  const noise = LiteGraph.createNode("Flux2KleinNoise");
  app.graph.add(noise);
  const width = noise.widgets.find((w) => w.name === "width");
  const height = noise.widgets.find((w) => w.name === "height");
  width.callback(1000);
  height.callback(1031);
  result.snapped = [width.value, height.value];
  app.canvas.draw(true, true);      // runs onDrawForeground with the token label
  return result;
}

(async () => {
  const browser = await chromium.launch({
    executablePath, headless: true,
    args: ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
           "--disable-component-update", "--disable-sync"],
  });
  const errors = [];
  const hostErrors = [];      // what the frontend logs by itself: the same page with this pack's extension disabled
  const setting = (value) => fetch(`${url}/settings/Comfy.Extension.Disabled`, {
    method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(value) });
  try {
    await setting([EXTENSION]);
    const bare = await browser.newPage({ viewport: VIEW });
    bare.on("console", (m) => { if (m.type() === "error") hostErrors.push(`${m.text()} [${m.location().url}]`); });
    bare.on("pageerror", (e) => hostErrors.push(String(e)));
    await bare.goto(url);
    await bare.waitForFunction(() => window.app?.graph, null, { timeout: 90000 });
    await bare.waitForTimeout(3000);
    await bare.close();
    await setting([]);
    const page = await browser.newPage({ viewport: VIEW });
    page.on("console", (m) => { if (m.type() === "error") errors.push(`${m.text()} [${m.location().url}]`); });
    page.on("pageerror", (e) => errors.push(String(e)));
    await page.goto(url);
    await page.waitForFunction(() => window.app?.graph, null, { timeout: 90000 });
    const loaded = await page.waitForFunction(() => window.__FLUX2_KLEIN_LOADED__, null, { timeout: 15000 })
      .then(() => true, () => false);
    if (!loaded) {                    // report what the console said instead of timing out blindly
      console.log(JSON.stringify({ loaded, errors, hostErrors }));
      return;
    }
    const workflows = { prompts: {}, layouts: {}, colours: [] };
    await page.evaluate(openWorkflow, { pack, name: SCREENSHOT_OF, margin: THUMBNAIL_MARGIN });   // one tab open
    await picture(page, screenshot);
    for (const name of JSON.parse(names)) {
      const opened = await page.evaluate(openWorkflow, { pack, name, margin: THUMBNAIL_MARGIN });
      workflows.prompts[name] = opened.prompt;
      workflows.layouts[name] = opened.layout;
      workflows.colours.push(...opened.colours);
    }
    // the thumbnails, from a larger window: every workflow fits it at a zoom the frontend draws nodes in full at
    await page.setViewportSize(THUMBNAIL_VIEW);
    for (const name of JSON.parse(names)) {
      const opened = await page.evaluate(openWorkflow, { pack, name, margin: THUMBNAIL_MARGIN });
      workflows.layouts[name].thumbnailScale = opened.layout.scale;
      await picture(page, path.join(thumbnails, `${name}.jpg`), { clip: opened.clip, ...THUMBNAIL });
    }
    await page.setViewportSize(VIEW);

    // the template browser, on this pack's page: each card's picture (a thumbnail arrives as a blob)
    await page.evaluate(() => window.app.extensionManager.command.execute("Comfy.BrowseTemplates"));
    await page.getByText(pack, { exact: true }).first().click();
    await page.waitForSelector("[role=dialog] img[alt]");
    const cards = {};                           // the grid draws the cards in view: scroll through it, until three
    for (let seen = -1, idle = 0; idle < 3;) {  // scrolls in a row show no new card (one may end short of a row;
                                                // a slow machine may draw a row a scroll late)
      idle = Object.keys(cards).length > seen ? 0 : idle + 1;
      seen = Object.keys(cards).length;
      await page.waitForFunction(() => [...document.querySelectorAll("[role=dialog] img[alt]")]
        .every((i) => i.complete && (i.src.startsWith("blob:") || i.src.endsWith(".png"))), null, { timeout: 10000 })
        .catch(() => null);                     // the test says which card lacks its picture
      Object.assign(cards, await page.evaluate(templateCards));
      await page.mouse.move(VIEW.width / 2, VIEW.height / 2);
      await page.mouse.wheel(0, VIEW.height / 2);
      await page.waitForTimeout(800);
    }
    await page.keyboard.press("Escape");

    const result = await page.evaluate(inPage, { prompts: JSON.parse(prompts) });
    result.colours.push(...workflows.colours);
    console.log(JSON.stringify({ loaded, ...workflows, ...result, cards, errors, hostErrors }));
  } finally {
    await browser.close();
  }
})().catch((e) => { console.error(e); process.exit(1); });
