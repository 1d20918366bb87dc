// One chat-completions call with the official openai-node SDK, its outcome as JSON on stdout.
// Usage: node contract.mjs '{"base_url": ..., "mode": "create"|"stream"|"helper", "request": {...}}'
// mode "stream" iterates the raw chunks; "helper" lets the SDK reassemble the stream
// (chat.completions.stream(...).finalChatCompletion()); "converse" asks job.turns one after the other,
// appending each answer's message as returned; "realtime" talks over /v1/realtime (OpenAIRealtimeWS).
// "transcribe" and "speech" call client.audio.transcriptions.create and client.audio.speech.create.
// An API error is reported, not thrown.
import { readFileSync } from "node:fs";
import OpenAI, { toFile } from "openai";

const job = JSON.parse(process.argv[2]);
// A request too large for one command-line argument (media) comes in a file.
if (job.request_file) job.request = JSON.parse(readFileSync(job.request_file, "utf8"));
const client = new OpenAI({ baseURL: job.base_url, apiKey: job.api_key ?? "unused", maxRetries: 0, timeout: 180000 });

async function run() {
  if (job.mode === "create") {
    return { completion: await client.chat.completions.create(job.request) };
  }
  if (job.mode === "stream") {
    const stream = await client.chat.completions.create({ ...job.request, stream: true });
    const chunks = [];
    for await (const chunk of stream) chunks.push(chunk);
    return { chunks };
  }
  if (job.mode === "converse") {
    // A conversation as the SDK's users write one: each answer's message, as the SDK returned it, is
    // appended to the messages before the next user turn (job.turns).
    const messages = [...job.request.messages];
    const completions = [];
    for (const turn of job.turns) {
      if (completions.length) messages.push(completions.at(-1).choices[0].message);
      messages.push({ role: "user", content: turn });
      completions.push(await client.chat.completions.create({ ...job.request, messages }));
    }
    return { completions };
  }
  if (job.mode === "realtime") {
    // A spoken conversation over the Realtime WebSocket (OpenAIRealtimeWS, on the ws package): each of
    // job.request.turns is base64 PCM16 at 24 kHz, appended, committed and answered before the next.
    const { OpenAIRealtimeWS } = await import("openai/realtime/ws");
    const rt = new OpenAIRealtimeWS({ model: job.request.model }, client);
    const events = [];
    let cursor = 0;
    let waiters = [];
    // the next event of a type (or of one of several types)
    const next = (type) =>
      new Promise((resolve) => {
        const check = () => {
          while (cursor < events.length) {
            const e = events[cursor++];
            if (e.type === type || (Array.isArray(type) && type.includes(e.type))) {
              resolve(e);
              return true;
            }
          }
          return false;
        };
        if (!check()) waiters.push(check);
      });
    rt.on("event", (e) => {
      events.push(e);
      waiters = waiters.filter((w) => !w());
    });
    rt.on("error", (err) => events.push({ type: "sdk_error", message: String(err?.message ?? err) }));
    await next("session.created");
    rt.send({ type: "session.update", session: { type: "realtime", output_modalities: ["audio"], audio: { input: { turn_detection: null } } } });
    await next("session.updated");
    // job.request.barge_in: {at: an event type}: the first answer is cancelled when that event comes, as a
    // client does when its caller speaks over it (response.cancel), and truncated at half of what had been
    // played (conversation.item.truncate; 24 kHz PCM16 is 48 bytes a millisecond). max_output_tokens: one
    // limit for every turn, or one per turn.
    const barge = job.request.barge_in;
    const limits = job.request.max_output_tokens;
    for (const [at, pcm] of job.request.turns.entries()) {
      rt.send({ type: "input_audio_buffer.append", audio: pcm });
      rt.send({ type: "input_audio_buffer.commit" });
      const limit = Array.isArray(limits) ? limits[at] : limits;
      rt.send(limit ? { type: "response.create", response: { max_output_tokens: limit } } : { type: "response.create" });
      if (barge && at === 0) {
        await next(barge.at);
        rt.send({ type: "response.cancel" });
        const done = await next("response.done");
        const played = events
          .filter((e) => e.type === "response.output_audio.delta")
          .reduce((n, e) => n + Buffer.from(e.delta, "base64").length, 0);
        const item = done.response.output?.[0]?.id;
        if (item) {
          rt.send({ type: "conversation.item.truncate", item_id: item, content_index: 0, audio_end_ms: Math.floor(played / 96) });
          await next(["conversation.item.truncated", "error"]);
        }
      } else {
        await next("response.done");
      }
    }
    rt.close();
    return { events };
  }
  if (job.mode === "transcribe") {
    // client.audio.transcriptions.create with the file as the SDK's users hand it over (toFile of bytes).
    const { file_b64, filename, ...fields } = job.request;
    const file = await toFile(Buffer.from(file_b64, "base64"), filename);
    return { transcription: await client.audio.transcriptions.create({ ...fields, file }) };
  }
  if (job.mode === "speech") {
    // client.audio.speech.create: the answer is the audio file itself, read whole.
    const response = await client.audio.speech.create(job.request);
    const audio = Buffer.from(await response.arrayBuffer());
    return { content_type: response.headers.get("content-type"), audio_b64: audio.toString("base64") };
  }
  if (job.mode === "helper") {
    const runner = client.chat.completions.stream({ ...job.request, stream: true });
    return { completion: await runner.finalChatCompletion() };
  }
  throw new Error(`unknown mode ${job.mode}`);
}

try {
  process.stdout.write(JSON.stringify(await run()));
} catch (err) {
  if (err instanceof OpenAI.APIError) {
    process.stdout.write(JSON.stringify({ error: { status: err.status ?? null, body: err.error ?? null } }));
  } else {
    throw err;
  }
}
