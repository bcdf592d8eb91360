#!/usr/bin/env bash
# Install Debian's headless Chromium and its WebDriver (packages chromium and chromium-driver), which
# the tree inspector's browser test (tests/e2e/test_inspector_browser.py) drives through Selenium
# (the dev extra). Playwright's own browser download is not needed. Idempotent: when
# /usr/bin/chromium and /usr/bin/chromedriver are there it only prints their versions. Needs
# apt-get, and root or sudo; any failure stops it with a non-zero exit code.
set -euo pipefail

if [ -x /usr/bin/chromium ] && [ -x /usr/bin/chromedriver ]; then
    echo "install-browser: already installed: $(/usr/bin/chromium --version 2>/dev/null); $(/usr/bin/chromedriver --version)"
    exit 0
fi
command -v apt-get >/dev/null || {
    echo "install-browser: no apt-get on this machine: install Debian's chromium and chromium-driver (/usr/bin/chromium, /usr/bin/chromedriver) another way" >&2
    exit 2
}
sudo=""
if [ "$(id -u)" -ne 0 ]; then
    command -v sudo >/dev/null || {
        echo "install-browser: apt-get needs root: run this script as root or install sudo" >&2
        exit 2
    }
    sudo=sudo
fi
$sudo apt-get update -q
$sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium chromium-driver
for program in /usr/bin/chromium /usr/bin/chromedriver; do
    [ -x "$program" ] || {
        echo "install-browser: apt-get finished but $program is missing (a distribution whose chromium package is a snap wrapper?)" >&2
        exit 1
    }
done
echo "install-browser: installed: $(/usr/bin/chromium --version 2>/dev/null); $(/usr/bin/chromedriver --version)"
