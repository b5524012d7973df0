# Sourced by setup-vllm.sh and setup-sglang.sh: an engine's venv layered on the core venv (.venv), so that
# torch, NIXL and Mooncake are installed once. A .pth file adds the base's site-packages behind the venv's
# own: what the venv installs shadows the base, never the reverse, and pip never changes the base from there
# (it does not uninstall outside its own environment).

site_of() { "$1/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])'; }
version_of() { "$1/bin/python" -c 'import sys; print(sys.version_info[:2])'; }

# layer_on VENV BASE CHECK: where BASE runs VENV's Python and the Python code CHECK succeeds in BASE, put
# BASE's site-packages behind VENV's and succeed; otherwise remove any such layering and fail.
layer_on() {
    local venv=$1 base=$2 check=$3 pth
    pth="$(site_of "$venv")/_kvferry_core_venv.pth"
    if [ -n "$base" ] && [ -x "$base/bin/python" ] && [ "$(version_of "$base")" = "$(version_of "$venv")" ] \
            && "$base/bin/python" -c "$check" >/dev/null 2>&1; then
        echo "import site; site.addsitedir('$(cd "$(site_of "$base")" && pwd -P)')" >"$pth"
        return 0
    fi
    rm -f "$pth"
    return 1
}
