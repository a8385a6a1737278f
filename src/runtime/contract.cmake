# mlc_lora_contract(<var> <NAME>): the constant NAME of python/mlc_lora/contract.py, the one
# definition of what the compiler, the runtime and the engines agree on. contract.py imports only
# the standard library, so this runs with any Python (${Python_EXECUTABLE}) at configure time.
set(MLC_LORA_CONTRACT_PY "${CMAKE_CURRENT_LIST_DIR}/../../python/mlc_lora/contract.py")
set_property(DIRECTORY APPEND PROPERTY CMAKE_CONFIGURE_DEPENDS "${MLC_LORA_CONTRACT_PY}")
function(mlc_lora_contract var name)
  execute_process(
    COMMAND "${Python_EXECUTABLE}" -c
            "import runpy, sys; print(runpy.run_path(sys.argv[1])[sys.argv[2]])" "${MLC_LORA_CONTRACT_PY}" "${name}"
    OUTPUT_VARIABLE value OUTPUT_STRIP_TRAILING_WHITESPACE COMMAND_ERROR_IS_FATAL ANY)
  set(${var} "${value}" PARENT_SCOPE)
endfunction()
