#!/usr/bin/env bash
# Reproduces the console's vendored chart library: uPlot, pinned, from the npm registry, copied with
# its licence into tracetrain/proxy/console/vendor/ (committed, so the gateway needs no network and no
# Node at run time). Run it only to change the version; needs npm.
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION=1.6.32
DEST=tracetrain/proxy/console/vendor
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
npm install --prefix "$scratch" --no-save --no-audit --no-fund --ignore-scripts "uplot@$VERSION" >/dev/null
mkdir -p "$DEST"
cp "$scratch/node_modules/uplot/dist/uPlot.iife.min.js" "$scratch/node_modules/uplot/dist/uPlot.min.css" "$DEST/"
cp "$scratch/node_modules/uplot/LICENSE" "$DEST/uPlot.LICENSE"
echo "uplot $VERSION" > "$DEST/VERSION"
echo "copied uPlot $VERSION into $DEST"
