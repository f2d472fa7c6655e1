#!/usr/bin/env bash
# Installs what the other-language protocol clients need (Node.js packages, C libraries).
# Filled in by the conformance tests; a no-op until they exist.
set -euo pipefail
exit 0
