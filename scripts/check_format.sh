#!/usr/bin/env bash
# Format and lint checks of the tracked sources: clang-format (.clang-format: Google base, 100
# columns) over the C, C++ and CUDA files, and ruff (pyproject.toml [tool.ruff]) over the Python
# of python/, tests/python/, bench/, scripts/ and dev/.
# Exits non-zero on any finding. To fix: clang-format -i <files>; ruff check --fix <paths>.
set -uo pipefail
cd "$(dirname "$0")/.."
status=0

mapfile -t cxx < <(git ls-files '*.h' '*.hpp' '*.c' '*.cc' '*.cpp' '*.cu' '*.cuh')
if [ ${#cxx[@]} -gt 0 ]; then
  log=$(mktemp)
  clang-format --dry-run -Werror "${cxx[@]}" 2>"$log"
  rc=$?
  if [ $rc -ne 0 ]; then
    files=$(grep -oE '^[^:]+:[0-9]+:[0-9]+: (error|warning)' "$log" | cut -d: -f1 | sort -u)
    nfiles=$(printf '%s\n' "$files" | grep -c .)
    nlines=$(grep -oE '^[^:]+:[0-9]+:' "$log" | sort -u | wc -l)
    head -n 40 "$log"
    echo "check_format: clang-format: $nlines lines in $nfiles of ${#cxx[@]} files need formatting:"
    printf '  %s\n' $files
    status=1
  else
    echo "check_format: clang-format: ${#cxx[@]} files clean"
  fi
  rm -f "$log"
fi

py_paths=()
for d in python tests/python bench scripts dev; do
  [ -n "$(git ls-files "$d/*.py")" ] && py_paths+=("$d")
done
if [ ${#py_paths[@]} -gt 0 ]; then
  if ruff check --no-cache --output-format concise "${py_paths[@]}"; then
    echo "check_format: ruff: clean (${py_paths[*]})"
  else
    echo "check_format: ruff found the findings above (${py_paths[*]})"
    status=1
  fi
fi
exit $status
