# Sourced by scripts/build.sh and scripts/test.sh (the fuzz build): compile
# through ccache when it is installed (scripts/setup.sh installs it), so a build
# of sources that barely changed takes its objects from the cache: the next CI
# run, a fresh clone, the ASan tree after an edit. A new machine builds cold.
#
# Objects are shared between clones at different paths: CCACHE_BASEDIR makes
# the paths under the checkout relative before they are hashed, and
# CCACHE_NOHASHDIR leaves the build directory's path out of the hash (it would
# only reach the -g1 line tables' compilation directory). The checkout's path
# itself is compiled into just the few files that read it (server/ and tests/
# CMakeLists.txt), which miss the cache from a new clone and only they.
# Expects $root, the checkout; sets ccache_args for cmake's configure step.
ccache_args=()
if command -v ccache >/dev/null; then
  export CCACHE_BASEDIR="$root" CCACHE_NOHASHDIR=1
  ccache_args=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
else
  # A tree configured with ccache once must not look for it again.
  ccache_args=(-DCMAKE_CXX_COMPILER_LAUNCHER=)
fi
