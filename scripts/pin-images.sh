#!/usr/bin/env bash
# Pins the base images of the Dockerfiles by digest, or refreshes the pins: every `FROM image:tag`
# (and the `# syntax=` frontend image) becomes `image:tag@sha256:<digest>`, where the digest is the
# one the tag names in its registry now (for a multi-platform image, its index, so that
# `docker buildx build --platform linux/amd64,linux/arm64` still finds every platform). The tag
# stays in the line for people and for the next refresh; the builder uses the digest only.
#   scripts/pin-images.sh                 pin or refresh docker/*.Dockerfile
#   scripts/pin-images.sh FILE...         only these files
#   scripts/pin-images.sh --check [FILE...]
#                                         no network: exit 1 naming each base without a digest
# Looking a tag up needs a registry and one of these clients, tried in this order: crane,
# skopeo, regctl, `docker buildx imagetools`. KVPOOL_PIN_RESOLVER=<command> replaces them (it is
# called with `image:tag` and prints `sha256:<64 hex digits>`); tests/packaging.rs uses it to
# check the rewriting offline. Files are rewritten only after every lookup succeeded.
set -euo pipefail
cd "$(dirname "$0")/.."

usage() {
  echo "usage: $0 [--check] [DOCKERFILE...]" >&2
  exit 2
}

check=false
files=()
for arg in "$@"; do
  case "$arg" in
    --check) check=true ;;
    -*) usage ;;
    *) files+=("$arg") ;;
  esac
done
if ((${#files[@]} == 0)); then
  shopt -s nullglob
  files=(docker/*.Dockerfile)
  shopt -u nullglob
  ((${#files[@]})) || { echo "pin-images.sh: no docker/*.Dockerfile" >&2; exit 1; }
fi

digest_re='^sha256:[0-9a-f]{64}$'

# The digest that `image:tag` names now.
resolve() {
  local ref=$1 out
  if [ -n "${KVPOOL_PIN_RESOLVER:-}" ]; then
    out=$($KVPOOL_PIN_RESOLVER "$ref")
  elif command -v crane >/dev/null 2>&1; then
    out=$(crane digest "$ref")
  elif command -v skopeo >/dev/null 2>&1; then
    # The digest of a manifest is the sha256 of its bytes as the registry serves them.
    out="sha256:$(skopeo inspect --raw "docker://$ref" | sha256sum | cut -d' ' -f1)"
  elif command -v regctl >/dev/null 2>&1; then
    out=$(regctl image digest "$ref")
  elif docker buildx version >/dev/null 2>&1; then
    out=$(docker buildx imagetools inspect "$ref" --format '{{.Manifest.Digest}}')
  else
    echo "pin-images.sh: no registry client: install crane, skopeo, regctl or docker buildx" >&2
    return 1
  fi
  if ! [[ "$out" =~ $digest_re ]]; then
    echo "pin-images.sh: $ref resolved to '$out', which is not a sha256 digest" >&2
    return 1
  fi
  printf '%s\n' "$out"
}

# Splits an image reference into "name:tag" (the digest, if any, removed). Refuses what cannot
# be pinned and refreshed: build arguments, and a reference without a tag.
tagged() {
  local ref=${1%%@*} file=$2 line=$3
  if [[ "$ref" == *'$'* ]]; then
    echo "$file:$line: $1 depends on a build argument; write the image out so it can be pinned" >&2
    return 1
  fi
  local last=${ref##*/}
  if [[ "$last" != *:* ]]; then
    echo "$file:$line: $1 has no tag; name one (the pin keeps it)" >&2
    return 1
  fi
  printf '%s\n' "$ref"
}

status=0
declare -A resolved=()
# Rewritten files wait here until every file is done: (temporary file, target) pairs.
pending=()
trap 'rm -f "${pending[@]}" "${out:-}"' EXIT
for file in "${files[@]}"; do
  [ -f "$file" ] || { echo "pin-images.sh: $file: no such file" >&2; exit 1; }
  declare -A stages=()
  out="$(mktemp "$file.pin.XXXXXX")"
  n=0
  changed=0
  while IFS= read -r line || [ -n "$line" ]; do
    n=$((n + 1))
    image=""
    if ((n == 1)) && [[ "$line" =~ ^#[[:space:]]*syntax=([^[:space:]]+)[[:space:]]*$ ]]; then
      image=${BASH_REMATCH[1]}
    elif [[ "$line" =~ ^FROM[[:space:]]+(--platform=[^[:space:]]+[[:space:]]+)?([^[:space:]]+)([[:space:]]+[Aa][Ss][[:space:]]+([^[:space:]]+))?[[:space:]]*$ ]]; then
      image=${BASH_REMATCH[2]}
      stage=${BASH_REMATCH[4]}
      # `FROM scratch` and `FROM <earlier stage>` name no image.
      if [ "$image" = scratch ] || [ -n "${stages[$image]:-}" ]; then
        image=""
      fi
      if [ -n "$stage" ]; then stages[$stage]=1; fi
    elif [[ "$line" =~ ^[Ff][Rr][Oo][Mm][[:space:]] ]]; then
      echo "$file:$n: cannot read this FROM line: $line" >&2
      exit 1
    fi
    if [ -z "$image" ]; then
      printf '%s\n' "$line" >>"$out"
      continue
    fi
    ref=$(tagged "$image" "$file" "$n")
    if $check; then
      digest=${image#*@}
      if [ "$digest" = "$image" ] || ! [[ "$digest" =~ $digest_re ]]; then
        echo "$file:$n: $image is not pinned by digest" >&2
        status=1
      fi
      continue
    fi
    # One lookup per tag for the whole run, so that files naming the same tag get the same pin.
    if [ -z "${resolved[$ref]:-}" ]; then
      resolved[$ref]=$(resolve "$ref")
    fi
    digest=${resolved[$ref]}
    pinned="$ref@$digest"
    if [ "$pinned" != "$image" ]; then
      echo "$file:$n: $ref -> $digest"
      changed=1
    fi
    printf '%s\n' "${line/"$image"/"$pinned"}" >>"$out"
  done <"$file"
  if ! $check && ((changed)); then
    chmod --reference="$file" "$out"
    pending+=("$out" "$file")
  else
    rm -f "$out"
  fi
  out=""
  unset stages
done
# Every lookup succeeded: replace each changed file in one step.
for ((i = 0; i < ${#pending[@]}; i += 2)); do
  mv "${pending[i]}" "${pending[i + 1]}"
done
pending=()
if $check && ((status == 0)); then
  echo "pin-images.sh: every base image is pinned by digest"
fi
exit "$status"
