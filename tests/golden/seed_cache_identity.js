// The node oracle for spec_cache.naming.namespace: mlx-bun's own captureSpeculativeOptions and
// speculativePrefixNamespace (src/spec/cache-identity.ts, 0.5.0; the seed diff), types removed, behind a
// JSON-lines protocol on stdin/stdout. Used by tests/test_namespace.py and tests/golden/make_namespaces.py.
//
// Requests, one JSON object a line (non-finite numbers travel as the strings "\u0000NaN", "\u0000Infinity",
// "\u0000-Infinity"):
//   {"op": "namespace", "method": str | null, "adapters": str | [str], "options": {...}}  (null method = undefined)
//   {"op": "stringify", "value": any}
//   {"op": "numbers", "values": [number]}
// Each answer is one JSON line: the namespace string, the JSON.stringify text, or the String() of each number.
const readline = require("readline");
const SENTINELS = { "\u0000NaN": NaN, "\u0000Infinity": Infinity, "\u0000-Infinity": -Infinity };
const revive = (k, v) =>
  (typeof v === "string" && Object.prototype.hasOwnProperty.call(SENTINELS, v)) ? SENTINELS[v] : v;

// mlx-bun src/spec/cache-identity.ts (0.5.0), types removed
function captureSpeculativeOptions(options) {
  return { ...options,
    ...(options.kvConfig ? { kvConfig: options.kvConfig.map(({ layerIdx, bits, groupSize }) =>
      ({ layerIdx, bits, groupSize })).sort((a, b) => a.layerIdx - b.layerIdx) } : {}),
    ...(options.turboQuant ? { turboQuant: { ...options.turboQuant } } : {}),
  };
}
function speculativePrefixNamespace(method, adapters, options) {
  return JSON.stringify({ method, adapters, kvBits: options.kvBits ?? null,
    kvGroupSize: options.kvGroupSize ?? 64, quantizedKvStart: options.quantizedKvStart ?? null,
    turboQuant: options.turboQuant ?? null,
    ...(options.kvConfig?.length ? { kvConfig: options.kvConfig } : {}),
  });
}

const rl = readline.createInterface({ input: process.stdin, crlfDelay: Infinity });
rl.on("line", (line) => {
  const req = JSON.parse(line, revive);
  let out;
  if (req.op === "namespace") {
    out = speculativePrefixNamespace(req.method === null ? undefined : req.method, req.adapters,
      captureSpeculativeOptions(req.options));
  } else if (req.op === "stringify") {
    out = JSON.stringify(req.value);
  } else if (req.op === "numbers") {
    out = req.values.map(String);
  } else {
    out = { error: "unknown op " + req.op };
  }
  process.stdout.write(JSON.stringify(out) + "\n");
});
