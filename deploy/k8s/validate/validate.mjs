// Schema validation of Kubernetes objects, offline: each object of a JSON array (argv[3]) is
// checked against the OpenAPI schema of its apiVersion and kind, as npm's kubernetes-models
// ships it (argv[2]: the node_modules folder it was installed into; tools/setup.sh installs it).
// Prints one line per object; exits 1 if any object is invalid or of a kind it has no schema for.
import { readFileSync, existsSync } from "node:fs";
import { join } from "node:path";
import { pathToFileURL } from "node:url";

const [modules, file] = process.argv.slice(2);
const objects = JSON.parse(readFileSync(file, "utf8"));
let failed = 0;
for (const o of objects) {
  const what = `${o.kind}/${o.metadata?.name}`;
  const [group, version] = o.apiVersion.includes("/") ? o.apiVersion.split("/") : [null, o.apiVersion];
  const path = join(modules, "kubernetes-models", ...(group ? [group, version] : [version]), `${o.kind}.js`);
  if (!existsSync(path)) {
    console.log(`INVALID ${what}: no schema for ${o.apiVersion} ${o.kind} in kubernetes-models`);
    failed++;
    continue;
  }
  const Model = (await import(pathToFileURL(path).href))[o.kind];
  try {
    new Model(o).validate();
    console.log(`valid ${o.apiVersion} ${what}`);
  } catch (e) {
    console.log(`INVALID ${what}: ${e.message.replace(/\s+/g, " ")}`);
    failed++;
  }
}
process.exit(failed ? 1 : 0);
