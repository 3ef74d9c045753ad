// Compile a Solidity standard-JSON input (stdin) with the pinned npm `solc` (solc-js) and print the
// standard-JSON output (stdout). Imports resolve only inside node_modules (e.g. @openzeppelin/contracts),
// so the build sees exactly the pinned packages and nothing from the network or the host.
"use strict";
const fs = require("fs");
const path = require("path");
const root = path.resolve(__dirname, "..");
const solc = require(path.join(root, "node_modules", "solc"));

function findImports(importPath) {
  const resolved = path.resolve(root, "node_modules", importPath);
  if (!resolved.startsWith(path.join(root, "node_modules") + path.sep)) {
    return { error: "import outside node_modules: " + importPath };
  }
  try {
    return { contents: fs.readFileSync(resolved, "utf8") };
  } catch (e) {
    return { error: "not found: " + importPath };
  }
}

const input = fs.readFileSync(0, "utf8");
const output = solc.compile(input, { import: findImports });
process.stdout.write(JSON.stringify({ solcVersion: solc.version(), output: JSON.parse(output) }));
