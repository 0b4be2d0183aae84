#!/usr/bin/env bash
# The Pulumi CLI for the rehearsal, built from its Go modules (the only way to get it on machines
# that reach nothing but package registries), cached by version and by this script's content.
#
#   scripts/toolchain.sh            build if needed; link .toolchain/bin/pulumi to the cached binary
#
# The CLI's main package (github.com/pulumi/pulumi/pkg/v3/cmd/pulumi) cannot be `go install`ed:
# pkg/go.mod replaces sdk/v3 with a relative path. So a small wrapper module requires pkg/v3 and
# sdk/v3 at the same version, copies pkg's one non-local replace, and builds the main package with
# the version stamped in. Cold: about 4 minutes on 2 cores; warm: nothing to do.
#
# The Python language host and the pulumi-command provider are not built here: the Go module
# proxy does not serve them (see docs/development.md, "What in the rehearsal is real"). The rehearsal runs the
# program inline (Automation API) and uses stand-in provider plugins from tests/e2e/providers.
set -euo pipefail
cd "$(dirname "$0")/.."

PULUMI_VERSION=v3.276.0
CLIPBOARD_REPLACE="github.com/tgummerer/clipboard v0.0.0-20241001131231-d02d263e614e"
CACHE=${SPARK_VLLM_TOOLCHAIN_CACHE:-/var/tmp/spark-vllm-toolchain}

go_version=$(go env GOVERSION)
key=$(cat "$0" | sha256sum | cut -c1-12)
out="$CACHE/pulumi-$PULUMI_VERSION-$go_version-$key"
mkdir -p .toolchain/bin

if [ ! -x "$out/bin/pulumi" ]; then
  echo "toolchain: building the Pulumi CLI $PULUMI_VERSION from Go modules with $go_version (cold: ~4 min on 2 cores)" >&2
  start=$(date +%s)
  work="$out.build.$$"
  rm -rf "$work" && mkdir -p "$work"
  cat > "$work/go.mod" <<EOF
module spark-vllm.local/toolchain/pulumi

go 1.26

require (
	github.com/pulumi/pulumi/pkg/v3 $PULUMI_VERSION
	github.com/pulumi/pulumi/sdk/v3 $PULUMI_VERSION
)

replace github.com/atotto/clipboard => $CLIPBOARD_REPLACE
EOF
  cat > "$work/tools.go" <<'EOF'
//go:build tools

package tools

import _ "github.com/pulumi/pulumi/pkg/v3/cmd/pulumi"
EOF
  export GOMODCACHE="$CACHE/go/mod" GOCACHE="$CACHE/go/build" GOFLAGS=-mod=mod GOTOOLCHAIN=local
  (cd "$work" && go mod tidy 2>"$work/tidy.log") || { cat "$work/tidy.log" >&2; exit 1; }
  echo "toolchain: modules resolved after $(( $(date +%s) - start )) s; compiling" >&2
  (cd "$work" && go build -trimpath \
      -ldflags "-s -w -X github.com/pulumi/pulumi/sdk/v3/go/common/version.Version=$PULUMI_VERSION" \
      -o "$work/bin/pulumi" github.com/pulumi/pulumi/pkg/v3/cmd/pulumi)
  mkdir -p "$out"
  rm -rf "$out/bin" && mv "$work/bin" "$out/bin" && cp "$work/go.mod" "$work/go.sum" "$out/"
  rm -rf "$work"
  echo "toolchain: built $out/bin/pulumi in $(( $(date +%s) - start )) s" >&2
fi
ln -sfn "$out/bin/pulumi" .toolchain/bin/pulumi
