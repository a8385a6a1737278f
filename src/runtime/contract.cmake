# mlc_lora_contract(<var> <NAME>): the constant NAME of python/mlc_lora/contract.py, the one
# definition of what the compiler, the runtime and the engines agree on (a dict, such as NCCL_ENV,
# comes as "KEY=VALUE KEY2=VALUE2"). contract.py imports only the standard library, so this runs
# with any Python (${Python_EXECUTABLE}) at configure time.
set(MLC_LORA_CONTRACT_PY "${CMAKE_CURRENT_LIST_DIR}/../../python/mlc_lora/contract.py")
set_property(DIRECTORY APPEND PROPERTY CMAKE_CONFIGURE_DEPENDS "${MLC_LORA_CONTRACT_PY}")
function(mlc_lora_contract var name)
  execute_process(
    COMMAND "${Python_EXECUTABLE}" -c
            "import runpy, sys; v = runpy.run_path(sys.argv[1])[sys.argv[2]]; \
print(' '.join(f'{k}={x}' for k, x in v.items()) if isinstance(v, dict) else v)"
            "${MLC_LORA_CONTRACT_PY}" "${name}"
    OUTPUT_VARIABLE value OUTPUT_STRIP_TRAILING_WHITESPACE COMMAND_ERROR_IS_FATAL ANY)
  set(${var} "${value}" PARENT_SCOPE)
endfunction()
