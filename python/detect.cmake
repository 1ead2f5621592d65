# Finds a Python 3 that imports torch and what the moerl_ep extension needs from it: the torch and
# pybind11 headers (torch's own include paths, which bundle pybind11 in pip wheels; /usr/include on
# Debian), torch's library folder, its C++ ABI and the extension suffix. The first python3 on PATH
# may lack torch (a pyenv shim), so /usr/bin/python3 is tried too; MOERL_PYTHON_EXECUTABLE picks one.
# Sets MOERL_PYTHON_FOUND and the MOERL_PYTHON_* / MOERL_TORCH_* variables used by python/CMakeLists.txt.
set(MOERL_PYTHON_FOUND OFF)
set(MOERL_PYTHON_EXECUTABLE "" CACHE FILEPATH "Python interpreter with torch for the moerl_ep binding")
find_program(_moerl_python_in_path python3)
set(_moerl_py_probe [=[
import os, sysconfig, torch
from torch.utils import cpp_extension
print(';'.join(cpp_extension.include_paths()))
print(os.path.join(os.path.dirname(torch.__file__), 'lib'))
print(int(torch._C._GLIBCXX_USE_CXX11_ABI))
print(sysconfig.get_config_var('EXT_SUFFIX'))
print(sysconfig.get_paths()['include'])
print(torch.__version__)
]=])
foreach(_py IN ITEMS ${MOERL_PYTHON_EXECUTABLE} ${_moerl_python_in_path} /usr/bin/python3)
  if(NOT EXISTS "${_py}")
    continue()
  endif()
  execute_process(COMMAND "${_py}" -c "${_moerl_py_probe}" OUTPUT_VARIABLE _out RESULT_VARIABLE _rc
                  ERROR_QUIET OUTPUT_STRIP_TRAILING_WHITESPACE)
  if(NOT _rc EQUAL 0)
    continue()
  endif()
  string(REGEX MATCHALL "[^\n]+" _lines "${_out}")
  list(LENGTH _lines _n)
  # include_paths() joined by ';' splits into several list items: the last five items are the rest.
  math(EXPR _first_rest "${_n} - 5")
  list(SUBLIST _lines 0 ${_first_rest} MOERL_TORCH_INCLUDE_DIRS)
  list(SUBLIST _lines ${_first_rest} 5 _rest)
  list(GET _rest 0 MOERL_TORCH_LIBRARY_DIR)
  list(GET _rest 1 MOERL_TORCH_CXX11_ABI)
  list(GET _rest 2 MOERL_PYTHON_EXT_SUFFIX)
  list(GET _rest 3 MOERL_PYTHON_INCLUDE_DIR)
  list(GET _rest 4 MOERL_TORCH_VERSION)
  find_path(_moerl_pybind11_dir pybind11/pybind11.h HINTS ${MOERL_TORCH_INCLUDE_DIRS})
  if(EXISTS "${MOERL_PYTHON_INCLUDE_DIR}/Python.h" AND _moerl_pybind11_dir)
    set(MOERL_PYTHON_FOUND ON)
    set(MOERL_PYTHON "${_py}")
    break()
  endif()
endforeach()
