// Drives ComfyUI's real frontend in headless Chromium for tests/comfyui/test_browser.py; prints one JSON object.
//   node browser_check.cjs <server url> <pack folder> <workflow names as JSON> <chromium> <screenshot path>
// Needs playwright-core on NODE_PATH.
const { chromium } = require("playwright-core");

const [url, pack, names, executablePath, screenshot] = process.argv.slice(2);

async function inPage({ pack, names }) {
  const app = window.app;
  const ours = (node) => node.type?.startsWith("Flux2Klein");
  const result = { registered: Object.keys(LiteGraph.registered_node_types).filter((t) => t.startsWith("Flux2Klein")),
                   prompts: {}, colours: [] };

  // every UI workflow, as the template browser serves it, through the frontend's own UI -> API conversion
  for (const name of names) {
    const workflow = await (await fetch(`/api/workflow_templates/${pack}/${name}.json`)).json();
    await app.loadGraphData(workflow);
    result.prompts[name] = (await app.graphToPrompt()).output;
    result.colours.push(...app.graph.nodes.filter(ours).map((n) => [n.color, n.bgcolor]));
  }

  // a new prompt node: live token estimate, and its warning past 512
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
  result.short = type("a red fox in the snow");
  result.long = type("a red fox in the snow, ".repeat(90));

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
  try {
    const page = await browser.newPage({ viewport: { width: 1600, height: 1000 } });
    page.on("console", (m) => { if (m.type() === "error") errors.push(`${m.text()} [${m.location().url}]`); });
    page.on("pageerror", (e) => errors.push(String(e)));
    await page.goto(url);
    await page.waitForFunction(() => window.app?.graph, null, { timeout: 90000 });
    const loaded = await page.waitForFunction(() => window.__FLUX2_KLEIN_LOADED__, null, { timeout: 15000 })
      .then(() => true, () => false);
    if (!loaded) {                    // report what the console said instead of timing out blindly
      console.log(JSON.stringify({ loaded, errors }));
      return;
    }
    const result = await page.evaluate(inPage, { pack, names: JSON.parse(names) });
    await page.screenshot({ path: screenshot });
    console.log(JSON.stringify({ loaded, ...result, errors }));
  } finally {
    await browser.close();
  }
})().catch((e) => { console.error(e); process.exit(1); });
