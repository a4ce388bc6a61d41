# Sourced by the device scripts (from the repository root) so that they install and lay out the tree one way.
#
# install_site: MLX's CUDA build into $SITE, once per machine: the wheel travels split (the carry limit is 64 MiB
# a call), part 00 copied to /tmp/parts by an earlier call (carry .gpu/p1), part 01 and the other wheels carried in
# .gpu/p2 (and .gpu/p3). INSTALL=0 (a CPU check of a script) installs nothing. Sets PYTHONPATH ($SITE:$SC, or $SC)
# and PYTHONUNBUFFERED. Returns 3 on a fresh machine whose part 00 is missing.
# farm DIR: spec_cache laid out in $SC as it installs (pyproject maps store/ and schemas/ to spec_cache.store and
# spec_cache.schemas): a symlink farm over DIR's spec_cache/, store/ and schemas/.
# Needs PY and SC set by the caller; SITE defaults to /tmp/site.
SITE=${SITE:-/tmp/site}

install_site() {
  if [ "${INSTALL:-1}" = 1 ]; then
    if [ ! -e "$SITE/mlx/lib/libmlx.so" ]; then
      local W=/tmp/mlx_cuda_13-0.32.4-py3-none-manylinux_2_35_x86_64.whl NV
      if [ ! -e /tmp/parts/mlxcuda.whl.part-00 ] || [ ! -e .gpu/p2/mlxcuda.whl.part-01 ]; then
        echo "FRESH MACHINE: /tmp/parts/mlxcuda.whl.part-00 (call 1, carry .gpu/p1) and .gpu/p2 (carry it here)" \
          "are both needed to install MLX"
        return 3
      fi
      cat /tmp/parts/mlxcuda.whl.part-00 .gpu/p2/mlxcuda.whl.part-01 > $W || return 1
      echo "94cb48fba73e5ee39467e51c35c51c691123359ca17bafd1a24cf92ad6732bee  $W" | sha256sum -c - || return 1
      # shellcheck disable=SC2046
      $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" $W \
        .gpu/p2/*.whl $(ls .gpu/p3/*.whl 2>/dev/null) || return 1
      rm -f $W
      NV=$($PY -c "import nvidia; print(list(nvidia.__path__)[0])") || return 1
      ln -sfn "$NV" "$SITE/nvidia"  # libmlx.so finds CUDA at $ORIGIN/../../nvidia
    fi
    export PYTHONPATH=$SITE:$SC
  else
    export PYTHONPATH=$SC
  fi
  export PYTHONUNBUFFERED=1
}

farm() {
  rm -rf "$SC" && mkdir -p "$SC/spec_cache" || return 1
  local e
  for e in "$1"/spec_cache/*; do ln -s "$(readlink -f "$e")" "$SC/spec_cache/"; done
  ln -sfn "$(readlink -f "$1/store")" "$SC/spec_cache/store"
  ln -sfn "$(readlink -f "$1/schemas")" "$SC/spec_cache/schemas"
}
