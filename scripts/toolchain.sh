#!/usr/bin/env bash
# Everything `pulumi` needs to run this program, laid out as on a user's machine: .toolchain/bin holds the
# CLI with the Python language host beside it (where the official distribution ships it, so the engine takes
# it as bundled), and .toolchain/plugins is a plugin directory (what `pulumi plugin install` fills, under
# $PULUMI_HOME/plugins) with the two provider plugins at the versions the SDKs in requirements.txt ask for:
# pulumi-resource-command 1.2.1 and pulumi-resource-docker 5.1.0. The engine checks those versions.
#
#   scripts/toolchain.sh             build what is missing from source (Go modules and the archives in
#                                    third_party/pulumi-providers, digests checked); link .toolchain/
#   scripts/toolchain.sh --install   a machine that reaches get.pulumi.com: the CLI on PATH (with its language
#                                    host), the plugins by `pulumi plugin install` (same versions); link .toolchain/
#
# Each build is cached in $SPARK_VLLM_TOOLCHAIN_CACHE (default /var/tmp/spark-vllm-toolchain), keyed by its
# version, the Go version, the archives' digests and its own recipe below, so a changed recipe rebuilds that
# piece only. Cold on 2 cores: the CLI about 4 min, the plugins and the language host about 4 min more.
#
# Why from source: these machines reach package registries only. The CLI's main package cannot be `go
# install`ed (pkg/go.mod replaces sdk/v3 with a relative path), so a wrapper module requires pkg/v3 and sdk/v3
# at one version. The plugins and the language host are not on the module proxy at all; their released
# sources are committed (third_party/pulumi-providers/README.md) and their Go dependencies are served.
set -euo pipefail
cd "$(dirname "$0")/.."

PULUMI_VERSION=v3.276.0
COMMAND_VERSION=1.2.1  # requirements.txt: pulumi-command==1.2.1
DOCKER_VERSION=5.1.0   # requirements.txt: pulumi-docker==5.1.0
SOURCES=$PWD/third_party/pulumi-providers
declare -A DIGEST=(
  [pulumi-command-v1.2.1-provider.tar.xz]=a04cc83e2b7b5c204d281d3c4dd13003e687c1e27fc8c6c1812bf74b92026802
  [pulumi-docker-v5.1.0-provider.tar.xz]=5ade5005e70a3a8e62e2ce08a915a2dca0407ed74c36d671e0a916dd184be779
  [terraform-provider-docker-5074970c.tar.xz]=dd8c0abd403c8cc34ccc61e5f5144dacdadad5e8dfbe53ddcbe8f31a3d9398e7
  [pulumi-language-python-1b5949891b.tar.xz]=8eb0088d35da0f07275ec67e6a75914e87bb77827506976daa07684c047b6d9c
)
CACHE=${SPARK_VLLM_TOOLCHAIN_CACHE:-/var/tmp/spark-vllm-toolchain}
BIN=$PWD/.toolchain/bin
mkdir -p "$BIN"
rm -f "$BIN"/pulumi-resource-*  # plugins live in .toolchain/plugins (a checkout from before kept them here)

if [ "${1:-}" = "--install" ]; then
  cli=$(command -v pulumi) || { echo "toolchain --install: no pulumi on PATH (https://www.pulumi.com/docs/install/)" >&2; exit 1; }
  ln -sfn "$cli" "$BIN/pulumi"
  pulumi plugin install resource command "$COMMAND_VERSION"
  pulumi plugin install resource docker "$DOCKER_VERSION"
  ln -sfn "${PULUMI_HOME:-$HOME/.pulumi}/plugins" .toolchain/plugins
  exit 0
fi

command -v go >/dev/null 2>&1 || export PATH="$PATH:/usr/local/go/bin"  # Go's own tarball location
command -v go >/dev/null 2>&1 || { echo "toolchain: Go 1.26 is needed (https://go.dev/dl); 'go' is not on PATH" >&2; exit 1; }
mkdir -p "$CACHE"
exec 9>"$CACHE/.lock" && flock 9  # one build at a time (CI builds beside a test lane; two checkouts may share it)
export GOMODCACHE="$CACHE/go/mod" GOCACHE="$CACHE/go/build" GOTOOLCHAIN=local
go_version=$(go env GOVERSION)

checked() {  # checked ARCHIVE: its path, once its digest is the one pinned above
  local path="$SOURCES/$1"
  echo "${DIGEST[$1]}  $path" | sha256sum --check --quiet >&2 || { echo "toolchain: $path is not the pinned archive" >&2; exit 1; }
  echo "$path"
}

# cached NAME VERSION RECIPE [BINARY…]: run RECIPE WORKDIR OUTDIR unless its output is cached (in $out/bin);
# link each BINARY into .toolchain/bin.
cached() {
  local name=$1 version=$2 recipe=$3; shift 3
  local key archives="" binary
  for archive in $(printf "%s\n" "${!DIGEST[@]}" | sort); do archives+="$archive=${DIGEST[$archive]} "; done
  key=$( { declare -f "$recipe"; echo "$version $go_version $archives"; } | sha256sum | cut -c1-12)
  out="$CACHE/$name-$version-$go_version-$key"
  if [ ! -f "$out/done" ]; then
    local start work="$out.build.$$"
    start=$(date +%s)
    echo "toolchain: building $name $version with $go_version" >&2
    rm -rf "$work" && mkdir -p "$work/bin"
    "$recipe" "$work" "$work/bin"
    rm -rf "$out" && mkdir -p "$out" && mv "$work/bin" "$out/bin" && rm -rf "$work" && touch "$out/done"
    echo "toolchain: built $name in $(( $(date +%s) - start )) s" >&2
  fi
  for binary in "$@"; do ln -sfn "$out/bin/$binary" "$BIN/$binary"; done
}

cli_recipe() {
  local work=$1 bin=$2
  cat > "$work/go.mod" <<EOF
module spark-vllm.local/toolchain/pulumi

go 1.26

require (
	github.com/pulumi/pulumi/pkg/v3 $PULUMI_VERSION
	github.com/pulumi/pulumi/sdk/v3 $PULUMI_VERSION
)

replace github.com/atotto/clipboard => github.com/tgummerer/clipboard v0.0.0-20241001131231-d02d263e614e
EOF
  printf '//go:build tools\n\npackage tools\n\nimport _ "github.com/pulumi/pulumi/pkg/v3/cmd/pulumi"\n' > "$work/tools.go"
  (cd "$work" && GOFLAGS=-mod=mod go mod tidy 2>"$work/tidy.log") || { cat "$work/tidy.log" >&2; exit 1; }
  (cd "$work" && GOFLAGS=-mod=mod go build -trimpath \
      -ldflags "-s -w -X github.com/pulumi/pulumi/sdk/v3/go/common/version.Version=$PULUMI_VERSION" \
      -o "$bin/pulumi" github.com/pulumi/pulumi/pkg/v3/cmd/pulumi)
  # The Python language host, beside the CLI as the official distribution has it: pulumi/pulumi's
  # sdk/python/cmd/pulumi-language-python, built against the CLI's version.
  tar -xJf "$(checked pulumi-language-python-1b5949891b.tar.xz)" -C "$work"
  local dir="$work/sdk/python/cmd/pulumi-language-python"
  (cd "$dir" && go mod edit -dropreplace github.com/pulumi/pulumi/pkg/v3 -dropreplace github.com/pulumi/pulumi/sdk/v3 \
      -require "github.com/pulumi/pulumi/pkg/v3@$PULUMI_VERSION" -require "github.com/pulumi/pulumi/sdk/v3@$PULUMI_VERSION")
  (cd "$dir" && GOFLAGS=-mod=mod go build -trimpath \
      -ldflags "-s -w -X github.com/pulumi/pulumi/sdk/v3/go/common/version.Version=$PULUMI_VERSION" \
      -o "$bin/pulumi-language-python" .)
  install -m 0755 "$work/sdk/python/cmd/pulumi-language-python-exec" "$bin/"
}

command_recipe() {
  local work=$1 bin=$2
  tar -xJf "$(checked pulumi-command-v1.2.1-provider.tar.xz)" -C "$work"
  (cd "$work/provider" && go build -trimpath \
      -ldflags "-s -w -X github.com/pulumi/pulumi-command/provider/pkg/version.Version=$COMMAND_VERSION" \
      -o "$bin/pulumi-resource-command" ./cmd/pulumi-resource-command)
}

docker_recipe() {  # pulumi-docker's provider over the terraform provider commit it pins, with its two patches
  local work=$1 bin=$2
  tar -xJf "$(checked pulumi-docker-v5.1.0-provider.tar.xz)" -C "$work"
  mkdir "$work/upstream" && tar -xJf "$(checked terraform-provider-docker-5074970c.tar.xz)" -C "$work/upstream"
  (cd "$work/upstream" && for p in ../patches/*.patch; do patch -p1 -s < "$p"; done)
  (cd "$work/provider/cmd/pulumi-resource-docker" && VERSION=$DOCKER_VERSION go run ./generate.go >/dev/null)
  (cd "$work/provider" && go build -trimpath \
      -ldflags "-s -w -X github.com/pulumi/pulumi-docker/provider/v5/pkg/version.Version=$DOCKER_VERSION" \
      -o "$bin/pulumi-resource-docker" ./cmd/pulumi-resource-docker)
}

plugins_recipe() {  # the plugin directory `pulumi plugin install` makes, from the two plugins built above
  local work=$1 bin=$2
  PULUMI_HOME="$bin" "$BIN/pulumi" plugin install resource command "$COMMAND_VERSION" --file "$command_bin" >&2
  PULUMI_HOME="$bin" "$BIN/pulumi" plugin install resource docker "$DOCKER_VERSION" --file "$docker_bin" >&2
}

cached pulumi "$PULUMI_VERSION" cli_recipe pulumi pulumi-language-python pulumi-language-python-exec
cached pulumi-resource-command "$COMMAND_VERSION" command_recipe
command_bin=$out/bin/pulumi-resource-command
cached pulumi-resource-docker "$DOCKER_VERSION" docker_recipe
docker_bin=$out/bin/pulumi-resource-docker
cached pulumi-plugins "$(echo "$command_bin $docker_bin" | sha256sum | cut -c1-12)" plugins_recipe
ln -sfn "$out/bin/plugins" .toolchain/plugins
